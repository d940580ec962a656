"""torch.distributed.checkpoint: ``loader.dcp_state()`` saves the position of every rank in one entry, and a run of
the same world size continues each rank exactly, while a run of another world size (or a second change after that)
reads exactly the samples the epoch had left."""

from __future__ import annotations

import datetime
import json
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shards
from shards.errors import InputError
from shards.position.dcp_state import KEY
from shards.loader.in_process import InProcess
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset
from tests.integrations.ranks import run_ranks

BATCH = 3
EPOCH_KEYS = [f"train_{i:05d}" for i in range(24)]


def _loader(folder: str):
    dataset = shards.open_dataset(folder, transform="eval", return_keys=True, seed=5,
                                  sampling=shards.Sampling(shuffle=True, shuffle_buffer=8))  # rank from the group
    return shards.make_loader(dataset, batch_size=BATCH, mode=WorkerProcesses(1), drop_last=False)


def _keys(batches) -> list[str]:
    return [key for _, _, keys in batches for key in keys]


def _rank(rank: int, world: int, folder: str, load_from: str | None, save_to: str | None, take: int,
          out: str) -> None:
    """Load ``load_from`` (if any), read ``take`` batches, save to ``save_to`` (if any), read the rest."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        loader = _loader(folder)
        if load_from is not None:
            dcp.load({"data": loader.dcp_state()}, checkpoint_id=load_from)
        batches = iter(loader)
        before = _keys(next(batches) for _ in range(take))
        if save_to is not None:
            dcp.save({"data": loader.dcp_state()}, checkpoint_id=save_to)
        after = _keys(batches)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"before": before, "after": after}))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, name: str, world: int, folder: Path, *, load_from: Path | None = None,
         save_to: Path | None = None, take: int = 0) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    run_ranks(_rank, world, str(folder), load_from and str(load_from), save_to and str(save_to), take, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _all(ranks: list[dict], part: str) -> list[str]:
    return [key for rank in ranks for key in rank[part]]


@pytest.mark.slow
def test_dcp_saves_one_position_that_every_world_size_continues(tmp_path):
    folder = tmp_path / "data"
    make_shard_dataset(folder, shard_sizes={"train": [9, 7, 8]}, size=(16, 16))  # 24 samples, 3 shards
    first = tmp_path / "first"
    saved = _run(tmp_path, "save", 2, folder, save_to=first, take=2)
    assert sorted(_all(saved, "before") + _all(saved, "after")) == EPOCH_KEYS  # 12 per rank: no padding
    # One entry for every rank: DCP keeps a single copy, which is right because the position is the same on all.
    assert set(dcp.FileSystemReader(str(first)).read_metadata().state_dict_metadata) == {f"data.{KEY}"}

    same = _run(tmp_path, "same", 2, folder, load_from=first)
    assert [r["after"] for r in same] == [r["after"] for r in saved]  # each rank bitwise where it stopped

    left = Counter(EPOCH_KEYS) - Counter(_all(saved, "before"))
    assert sum(left.values()) == 12
    for world in (1, 3):
        resumed = _run(tmp_path, f"world{world}", world, folder, load_from=first)
        assert Counter(_all(resumed, "after")) == left  # exactly the rows left, none twice, none lost

    # A second layout change: 3 ranks take a batch each and save (the state now chains to the 2-rank one).
    second = tmp_path / "second"
    three = _run(tmp_path, "three", 3, folder, load_from=first, save_to=second, take=1)
    left_after_three = left - Counter(_all(three, "before"))
    assert sum(left_after_three.values()) == 12 - 3 * BATCH
    one = _run(tmp_path, "one", 1, folder, load_from=second)  # one rank: no padding to its share
    assert Counter(_all(one, "after")) == left_after_three


def test_dcp_state_refuses_an_entry_it_did_not_write(tmp_path):
    make_shard_dataset(tmp_path, shard_sizes={"train": [4]}, size=(16, 16))
    state = shards.make_loader(shards.open_dataset(tmp_path), batch_size=2, mode=InProcess()).dcp_state()
    for entry in ({}, {KEY: 3}, {KEY: "{not json"}):
        with pytest.raises(InputError, match=KEY):
            state.load_state_dict(entry)
