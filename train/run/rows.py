"""An epoch's row of ``metrics.jsonl`` (``shards.runrecord.EpochRow``): the numbers every rank contributes to, the
findings the loop makes from them (``train.run.diagnose``), and the log lines that say the same.

The sums, counters and stage seconds are reduced over ranks here, so every rank builds the same row; rank 0 alone
writes and logs it.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from shards.cache.node_index import ideal_fetch_bytes
from shards.runrecord import EpochRow
from shards.units import human_bytes
from train.config import TrainConfig
from train.data import CACHE_COUNTERS, RunData, source_paths
from train.distributed import DistContext
from train.model.metrics import CONFUSION_IN_METRICS_MAX_CLASSES
from train.run import diagnose
from train.run.epoch import TrainState
from train.run.meter import DataWaitMeter, gather_stage_seconds, sum_stage_seconds

log = logging.getLogger("shardcache.train")


def reads_over_network(cfg: TrainConfig, kind: str) -> bool:
    """Whether every epoch reads image shards over the network uncached (``diagnose.reads_over_network``)."""
    return diagnose.reads_over_network(kind, source_paths(cfg), cache_images=cfg.cache.images,
                                       cache_dir=cfg.cache.dir)


class EpochRows:
    """Builds each epoch's row; keeps the node-cache counters of the last epoch's end, to count this epoch's."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, data: RunData, task: Any) -> None:
        self.cfg, self.ctx, self.data, self.task = cfg, ctx, data, task
        self._cache_before: dict[str, int] = {}
        self.network_reads = reads_over_network(cfg, data.kind)

    def row(self, state: TrainState, meter: DataWaitMeter, lr: float, val: dict[str, Any]) -> EpochRow:
        """The epoch ``state`` has just finished, with its validation scores ``val``; collective (all ranks)."""
        samples_per_s, wait_share = meter.reduced(self.ctx.device)
        sums = torch.tensor([state.loss_sum, float(state.correct), float(state.samples)], dtype=torch.float64,
                            device=self.ctx.device)
        if self.ctx.distributed:
            torch.distributed.all_reduce(sums)
        if len(self.data.classes) > CONFUSION_IN_METRICS_MAX_CLASSES:
            val = {k: v for k, v in val.items() if k != "val_confusion"}
        fields: dict[str, Any] = {
            "epoch": state.epoch + 1, "step": state.step, "lr": lr, **self.task.train_fields(*sums.tolist()),
            "samples_per_s": samples_per_s, "data_wait_share": wait_share, "epoch_time_s": meter.wall_s, **val,
            **self.cache_fields(), **self.stage_fields(meter),
            "quarantined": len(self.data.train_loader.quarantined)}  # samples kept out so far
        if self.data.mixture is not None:  # samples each source filled this epoch (fixed by the mixture's draw)
            fields["mixture_drawn"] = list(self.data.mixture.draw)
        loader = self.data.train_loader
        fields["run_mode"] = {"mode": str(loader.mode), **(loader.mode_choice() or {})}
        if state.first_batch:  # the starts and resumes of this epoch (train.run.first_batch), rank 0's numbers
            fields["first_batch"], state.first_batch = state.first_batch, []
        fields.update(self.findings(fields, state.history))
        return EpochRow(**fields)

    def findings(self, fields: dict[str, Any], history: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """What the loop concludes from the epoch (``train.run.diagnose``): recorded, logged, rendered."""
        share, seconds = fields["data_wait_share"], fields["epoch_time_s"]
        advice = diagnose.wait_advice(share, share * seconds, data_kind=self.data.kind, workers=self.data.workers,
                                      stages=fields.get("stage_seconds"), decode=self.cfg.loader.decode,
                                      network_reads=self.network_reads)
        return {"wait_advice": advice, "straggler_warning": diagnose.run_straggler_warning([*history, fields])}

    def cache_fields(self) -> dict[str, Any]:
        """This epoch's node-cache counters over all ranks: ``cache_hit_rate`` (shards served from a node's cache
        without fetching, of all shard reads through it), ``fetched_bytes`` (bytes fetched from the source) and
        ``cache`` (every counter, evictions by reason, and ``ideal_bytes``: what did not fit, the floor)."""
        counts = self.data.cache_counts()
        if counts is None:
            return {}
        totals = torch.tensor([counts[name] for name in CACHE_COUNTERS], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.distributed:
            torch.distributed.all_reduce(totals)
        now = dict(zip(CACHE_COUNTERS, (int(v) for v in totals.tolist())))
        epoch = {name: now[name] - self._cache_before.get(name, 0) for name in CACHE_COUNTERS}
        self._cache_before = now
        epoch["ideal_bytes"] = ideal_fetch_bytes(epoch["planned_bytes"], self.cfg.cache.limit, self.ctx.nodes)
        lookups = epoch["hits"] + epoch["misses"]
        return {"cache_hit_rate": epoch["hits"] / lookups if lookups else None, "fetched_bytes": epoch["fetched_bytes"],
                "cache": epoch}

    def stage_fields(self, meter: DataWaitMeter) -> dict[str, Any]:
        """Where the epoch's time went: ``stage_seconds`` summed over ranks (worker stages: busy seconds summed over
        each rank's workers; loop stages: wall seconds of each rank's loop), ``stage_seconds_by_rank``, and under
        DDP the slowest rank and every rank's wait and step (``diagnose.straggler_fields``)."""
        by_rank = gather_stage_seconds(meter.stage_seconds, self.ctx.device)
        return {"stage_seconds": sum_stage_seconds(by_rank), "stage_seconds_by_rank": by_rank,
                **diagnose.straggler_fields(by_rank)}

    def log(self, row: EpochRow) -> None:
        fields = row.to_json()
        log.info("epoch %d/%d: train_loss %.4f, val_loss %.4f, %s | %.0f samples/s, data wait %.1f%%",
                 row.epoch, self.cfg.optim.epochs, row.train_loss, row.val_loss, self.task.describe(fields),
                 row.samples_per_s, 100 * row.data_wait_share)
        if row.straggler is not None:
            log.info("epoch %d slowest rank: %s", row.epoch, row.straggler)
        if row.straggler_warning:
            log.warning(row.straggler_warning)
        if row.cache is not None:
            rate = row.cache_hit_rate
            log.info("node cache: hit rate %s, fetched %s (the floor: %s), served %s from the cache",
                     "n/a" if rate is None else f"{rate:.0%}", human_bytes(row.fetched_bytes),
                     human_bytes(row.cache["ideal_bytes"]), human_bytes(row.cache["served_bytes"]))
        if row.wait_advice:
            log.warning(row.wait_advice)
