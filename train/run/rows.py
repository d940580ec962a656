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
from shards.errors import ShardcacheError
from shards.forecast.plan import forecast
from shards.forecast.run import COMPARED, epoch_forecast
from shards.transport import s3
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


def storage_forecast(cfg: TrainConfig, ctx: DistContext, data: RunData) -> Any:
    """The forecast of the train reads (``shards.forecast.plan``) over the train loader's own dataset and run mode
    (a mixture, a subset, class weights and feature rows included), made once as the run starts; None where it
    cannot be made (said once, never fatal: a forecast is an aid)."""
    loader = data.train_loader
    try:
        return forecast(loader.dataset, loader.mode, cfg.optim.epochs, batch_size=loader.batch_size,
                        cache=cfg.cache.shard_cache)
    except ShardcacheError as exc:
        log.info("no storage forecast for this run: %s", exc)
        return None


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
        self.forecast = storage_forecast(cfg, ctx, data) if ctx.is_main else None
        s3.share_stats()  # before any worker starts: the workers' requests count in this process's counters
        self._storage_before = self._storage_now()
        self._storage_train: list[int] | None = None

    def _storage_now(self) -> list[int]:
        """Requests and bytes sent to object storage by this process and its workers so far, and the train reader's
        node-cache counters (``COMPARED``'s order)."""
        cache = getattr(self.data.train_loader.dataset, "shard_cache", None)
        counts = cache.stats.snapshot() if cache is not None else {}
        return [s3.FETCH_STATS.requests, s3.FETCH_STATS.bytes, *(int(counts.get(name, 0)) for name in COMPARED[2:])]

    def train_done(self) -> None:
        """The epoch's training reads are over (validation reads next): what they sent is counted up to here."""
        self._storage_train = self._storage_now()

    def forecast_fields(self, epoch: int) -> dict[str, Any]:
        """The forecast of epoch ``epoch`` (from 0) beside what its train reads measured, summed over ranks;
        collective. Nothing when the run has no forecast (features, a mixture, an error making it)."""
        now = self._storage_train if self._storage_train is not None else self._storage_now()
        spent = torch.tensor([a - b for a, b in zip(now, self._storage_before)], dtype=torch.float64,
                             device=self.ctx.device)
        self._storage_before, self._storage_train = self._storage_now(), None
        if self.ctx.distributed:
            torch.distributed.all_reduce(spent)
        if self.forecast is None or epoch >= len(self.forecast.ranks):
            return {}
        measured = dict(zip(COMPARED, (int(v) for v in spent.tolist())))
        if getattr(self.data.train_loader.dataset, "shard_cache", None) is None:
            measured = {name: measured[name] for name in COMPARED[:2]}
        return {"forecast": epoch_forecast(self.forecast, epoch), "storage": measured}

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
            "quarantined": len(self.data.train_loader.quarantined),  # samples kept out so far
            **self.forecast_fields(state.epoch)}
        if self.data.mixture is not None:  # samples each source filled this epoch (fixed by the mixture's draw)
            fields["mixture_drawn"] = list(self.data.mixture.draw)
        loader = self.data.train_loader
        fields["run_mode"] = {"mode": str(loader.mode), **(loader.mode_choice() or {})}
        if meter.memory is not None:  # rank 0's memory in flight over the epoch, beside its data wait
            fields["memory"] = meter.memory.record((self.data.memory_budget or {}).get("bytes"))
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
        classes = len(self.data.classes) if self.data.task == "classification" else 0
        return {"wait_advice": advice, "straggler_warning": diagnose.run_straggler_warning([*history, fields]),
                "verdicts": diagnose.verdicts(fields, classes, lr=self.cfg.optim.lr)}

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
        for verdict in row.verdicts or ():
            if verdict["level"] == "bad" and verdict["rule"] != "data":  # the data verdict is wait_advice's line
                log.warning("epoch %d: %s", row.epoch, verdict["text"])
