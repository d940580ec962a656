"""Hugging Face accelerate: ``Accelerator.prepare`` hands a shardcache loader back untouched (it wraps only torch
``DataLoader``s), so 2 processes read each their own share of the epoch: every sample once, none twice; and
``register_for_checkpointing`` carries the position through ``save_state``/``load_state``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shards
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset
from tests.integrations.ranks import run_ranks

pytestmark = pytest.mark.slow

SAMPLES = 24
EPOCH_KEYS = [f"train_{i:05d}" for i in range(SAMPLES)]
TAKE = 2


def _loader(folder: str):
    dataset = shards.open_dataset(folder, transform="eval", return_keys=True, seed=3,
                                  sampling=shards.Sampling(shuffle=True, shuffle_buffer=8))  # rank from the group
    return shards.make_loader(dataset, batch_size=3, mode=WorkerProcesses(1))


def _keys(batches) -> list[str]:
    return [key for _, _, keys in batches for key in keys]


def _rank(rank: int, world: int, folder: str, out: str) -> None:
    import accelerate  # here, not at collection: the test imported it (or skipped) before starting the ranks
    from accelerate.state import AcceleratorState

    # the ranks are forked: an Accelerator made earlier in the test process (docs/integrations.md's block runs in
    # the suite) left its one-process state in accelerate's singletons, which the fork copied
    AcceleratorState._reset_state(reset_partial_state=True)

    # Reads RANK, WORLD_SIZE, MASTER_ADDR/PORT and starts gloo. The batch settings that reshape a DataLoader's
    # batches are on, to show they do not reach this loader.
    settings = accelerate.DataLoaderConfiguration(split_batches=True, dispatch_batches=True, even_batches=False)
    accelerator = accelerate.Accelerator(cpu=True, dataloader_config=settings)
    assert accelerator.num_processes == world and accelerator.process_index == rank
    loader = _loader(folder)
    assert accelerator.prepare(loader) is loader  # not wrapped: no IterableDatasetShard, no dispatching
    assert loader.dataset.config.world_size == world
    accelerator.register_for_checkpointing(loader)
    batches = iter(loader)
    before = _keys(next(batches) for _ in range(TAKE))
    accelerator.save_state(str(Path(out, "state")))  # the main process writes the loader's state_dict
    after = _keys(batches)
    accelerator.wait_for_everyone()

    resumed_loader = _loader(folder)
    restart = accelerate.Accelerator(cpu=True)  # as a new run would: its own loader, registered the same way
    restart.register_for_checkpointing(resumed_loader)
    restart.load_state(str(Path(out, "state")))
    resumed = _keys(resumed_loader)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"before": before, "after": after, "resumed": resumed}))
    accelerator.end_training()


def test_prepare_leaves_the_per_rank_split_alone_and_save_state_resumes(tmp_path):
    pytest.importorskip("accelerate", reason="pip install 'shardcache[integrations]'")
    make_shard_dataset(tmp_path / "data", shard_sizes={"train": [10, 6, 8]}, size=(16, 16))
    run_ranks(_rank, 2, str(tmp_path / "data"), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    read = [key for rank in ranks for key in rank["before"] + rank["after"]]
    assert sorted(read) == EPOCH_KEYS  # the epoch once over the two ranks: no duplicate, no loss
    for rank in ranks:
        assert rank["resumed"] == rank["after"]  # each rank continues where it saved
