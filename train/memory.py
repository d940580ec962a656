"""The training run's loader memory budget (``--memory-budget``, ``shards.loader.budget``), resolved once per process.

Under torchrun the ranks of a node share its memory, and only train knows how many there are
(``DistContext.local_world_size``: the CLI layer reads torchrun's variables, the library reads none), so the
default is divided here. The remote read-ahead is part of the budget but is fixed when the datasets open, before
any loader exists: it is sized here, per reading process, within ``READ_AHEAD_SHARE`` of the budget. What was
resolved goes into ``run.json`` (``memory_budget``) beside the data call, which records only what changes samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shards.loader.budget import MemoryBudget, read_ahead_within, resolve_budget
from shards.loader.loader import default_num_workers
from train.config import TrainConfig
from train.distributed import DistContext


@dataclass(frozen=True)
class LoaderBudget:
    """This process's loader budget, the S3 options with the read-ahead sized from it (None: local data), and the
    record ``run.json`` states."""

    budget: MemoryBudget
    storage_options: dict[str, Any] | None
    record: dict[str, Any]


def reading_processes(cfg: TrainConfig, kind: str) -> int:
    """The processes that read shards for one loader: its worker processes, else this one."""
    options = cfg.loader
    if kind != "images" or options.run_mode == "threads" or options.workers == 0:
        return 1
    return options.workers if options.workers is not None else default_num_workers()


def loader_budget(cfg: TrainConfig, ctx: DistContext, kind: str) -> LoaderBudget:
    """``--memory-budget`` (else the default, shared by the node's ranks) and the read-ahead it leaves each
    reading process (at most the asked ``--s3-read-ahead``)."""
    from shards.transport.s3 import S3Options

    budget = resolve_budget(cfg.loader.memory_budget, ranks=ctx.local_world_size)
    storage, read_ahead, processes = cfg.cache.storage_options, None, reading_processes(cfg, kind)
    if storage is not None:
        read_ahead = read_ahead_within(budget, processes, S3Options.from_mapping(storage).read_ahead_bytes)
        storage = {**storage, "read_ahead_bytes": read_ahead}
    return LoaderBudget(budget, storage, budget.record(reading_processes=processes,
                                                       read_ahead_bytes_per_process=read_ahead))
