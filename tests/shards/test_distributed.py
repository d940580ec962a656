"""Two gloo processes over uneven shards: equal step counts (no DDP hang), every sample read, rank auto-detected."""

import datetime
import json
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import shards
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset

WORLD = 2
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(rank: int, folder: str, port: int, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        dataset = shards.open_dataset(folder, transform="eval", return_keys=True, seed=1)  # rank from dist
        loader = shards.make_loader(dataset, batch_size=3, mode=WorkerProcesses(1, persistent=False), drop_last=False)
        keys, steps = [], 0
        for _, labels, batch_keys in loader:
            keys += list(batch_keys)
            dist.all_reduce(labels.float().sum())  # a collective per step, as DDP's gradient sync would do
            steps += 1
        dist.barrier()
        with open(os.path.join(results, f"rank{rank}.json"), "w") as handle:
            json.dump({"rank": dataset.config.rank, "world": dataset.config.world_size, "keys": keys,
                       "steps": steps, "len": len(loader)}, handle)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # starts two ranks and a process group
def test_two_ranks_over_uneven_shards(tmp_path):
    folder = tmp_path / "data"
    make_shard_dataset(folder, shard_sizes={"train": [9, 1, 4, 2, 7]}, size=(16, 16))  # 23 samples, 5 shards
    context = mp.start_processes(_run_rank, args=(str(folder), _free_port(), str(tmp_path)), nprocs=WORLD,
                                 join=False, start_method="fork")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
    while not context.join(timeout=5):
        assert datetime.datetime.now() < deadline, "distributed run hung"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["rank"] for r in results] == [0, 1] and {r["world"] for r in results} == {WORLD}
    assert len(results[0]["keys"]) == len(results[1]["keys"]) == 12
    assert results[0]["steps"] == results[1]["steps"] == results[0]["len"]
    seen = results[0]["keys"] + results[1]["keys"]
    assert set(seen) == {f"train_{i:05d}" for i in range(23)}  # one padded repeat, nothing missing
