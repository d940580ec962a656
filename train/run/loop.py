"""``train(cfg) -> dict``: the training run from manifest to ``model.pt``, in one process or under torchrun.

Order of work: check the input (manifest, freshness, splits), join the process group, decide what the run folder
allows, build loaders, model and optimizer, restore a checkpoint, then epochs of train + validate + checkpoint.
Every rank computes; rank 0 alone logs and writes.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from train.run import run_dir as rd
from train.run.checkpoint import capture_rng_state, copy_checkpoint, load_checkpoint, restore_rng_state, save_checkpoint
from train.config import TrainConfig
from shards.data_events import append_event, read_events
from train.run.lineage import KeyRecorder, keep_keys_file
from shards.cache.node_index import ideal_fetch_bytes
from train.data import CACHE_COUNTERS, RunData, build_data, describe_batch, prepare_manifest, source_paths
from train.distributed import DistContext, setup_distributed, wrap_model
from train.run.first_batch import describe, first_batch_record
from train.run.epoch import StepContext, TrainState, evaluate, run_train_epoch
from train.run.meter import gather_stage_seconds, sum_stage_seconds
from train.model.metrics import CONFUSION_IN_METRICS_MAX_CLASSES
from train.model.models import build_head, build_image_model, check_image_model
from train.model.optim import build_optimizer, build_scheduler
from train.run.plot import plot_curves
from shards.report import advice
from shards.report.stages import row_straggler, run_straggler_warning, straggler_fields
from shards.units import human_bytes
from train.prefetch import ThreadPrefetcher
from train.model.probe_run import fit_probe, prepare_features
from train.model.standardize import FeatureScale
from train.model.regression import RegressionLoss, TargetScale, evaluate_regression

# Redraw curves.png and report.html after an epoch only when they are this old (see refresh_views).
VIEW_REFRESH_S = 30.0
log = logging.getLogger("shardcache.train")


def train(cfg: TrainConfig, *, started: float | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; return the summary (last and best val top-1, or val R², MSE and MAE for regression;
    throughput, data-wait share, run dir).

    ``started``: the ``time.perf_counter()`` the time to first batch counts from (``train.run.first_batch``; the CLI
    passes its entry), else this call."""
    started = time.perf_counter() if started is None else started
    manifest = prepare_manifest(cfg)
    if manifest.kind == "images":
        check_image_model(cfg.model, cfg.weights)
    plan = None if cfg.dry_run else rd.plan_run(cfg)
    ctx = setup_distributed(cfg.device)
    if not ctx.is_main:
        logging.getLogger("shardcache").setLevel(logging.WARNING)  # one voice per job: rank 0's
    data: RunData | None = None
    try:
        if cfg.amp and ctx.device.type != "cuda":
            log.warning("--amp needs CUDA; training in float32 on %s", ctx.device)
        data = build_data(cfg, manifest, ctx)
        scale = prepare_features(cfg, data)  # standardising and --head logreg: checked and measured before writing
        if plan is None:
            return dry_run(cfg, data)
        ctx.barrier()  # every rank has judged the folder before rank 0 writes into it
        if ctx.is_main:
            rd.start_run(plan, cfg, mixture=data.mixture_record(cfg), scale=None if scale is None else scale.to_dict())
        ctx.barrier()
        return Run(cfg, ctx, data, plan, started, scale).fit()
    finally:
        if data is not None:
            data.close()
        ctx.close()


def dry_run(cfg: TrainConfig, data: RunData) -> dict[str, Any]:
    """Build everything, look at one training batch, write nothing."""
    batch = next(iter(data.train_loader))
    loader_dtype = str(batch[0].dtype).removeprefix("torch.")
    if data.normalize is not None:  # report what the model sees, after the per-batch normalisation
        batch = (data.normalize(batch[0].to(next(data.normalize.buffers()).device)).cpu(), batch[1])
    report = {"dry_run": True, "data": data.kind, "task": data.task, "classes": len(data.classes),
              "train_batches": len(data.train_loader), "val_batches": len(data.val_loader),
              "loader_dtype": loader_dtype, **describe_batch(batch, data.classes)}
    log.info("dry run: batch %s %s, values [%.4g, %.4g], %s %s", report["batch_shape"], report["dtype"],
             report["min"], report["max"], *(("targets in", report["target_range"]) if "target_range" in report
                                             else ("labels", report["label_counts"])))
    return report


def reads_over_network(cfg: TrainConfig, kind: str) -> bool:
    """Whether every epoch reads image shards over the network uncached (``shards.report.advice``, the rule the run
    report applies to the same config)."""
    return advice.reads_over_network(kind, source_paths(cfg), cache_images=cfg.cache_images, cache_dir=cfg.cache_dir)


def build_model(cfg: TrainConfig, data: RunData, scale: FeatureScale | None = None) -> nn.Module:
    if data.kind == "features":
        outputs = 1 if data.task == "regression" else len(data.classes)
        return build_head(cfg.head, data.features_dim, outputs, hidden_dim=cfg.hidden_dim, dropout=cfg.dropout,
                          scale=scale)
    return build_image_model(cfg.model, len(data.classes), weights=cfg.weights)


def class_weights(counts: list[int]) -> torch.Tensor:
    """Inverse class frequency, normalised so a balanced dataset gets all ones; absent classes get zero."""
    total, present = sum(counts), sum(1 for c in counts if c > 0)
    return torch.tensor([total / (present * c) if c > 0 else 0.0 for c in counts], dtype=torch.float32)


@dataclass
class Run:
    cfg: TrainConfig
    ctx: DistContext
    data: RunData
    plan: rd.RunPlan
    started: float  # the perf_counter the time to first batch counts from
    scale: FeatureScale | None = None  # the train split's feature mean and std, when standardising (train.model.standardize)

    def __post_init__(self) -> None:
        cfg, device = self.cfg, self.ctx.device
        self.amp = cfg.amp and device.type == "cuda"
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every rerun
        self.model = build_model(cfg, self.data, self.scale).to(device)
        self.optimizer = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, self.optimizer, len(self.data.train_loader))
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp)
        weight = class_weights(self.data.train_class_counts(cfg.train_split)).to(device) \
            if cfg.class_weighted_loss else None
        self.regression = self.data.task == "regression"
        if self.regression:
            self.loss_fn: nn.Module = RegressionLoss(TargetScale.from_config(self.data.manifest.config), cfg.loss)
        else:
            self.loss_fn = nn.CrossEntropyLoss(weight=weight, label_smoothing=cfg.label_smoothing)
        self.state = TrainState()
        self.resumed_loader: dict[str, Any] | None = None  # the loader state this start resumed from (lineage)
        self._cache_before: dict[str, int] = {}  # node-cache counters at the last epoch's end (cache_row)
        # When curves.png and report.html were last drawn: from the start, so a run of short epochs draws them
        # once at its end, a long one after every epoch.
        self._views_at = time.monotonic()
        if self.plan.resume_from is not None:
            self.restore(load_checkpoint(self.plan.resume_from))
        self.ddp_model = wrap_model(self.model, self.ctx)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def checkpoint_state(self, loader_state: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
            "loader": loader_state, "train_state": self.state.to_dict(), "rng": capture_rng_state(),
            "config": self.cfg.to_dict(), "classes": list(self.data.classes),
        }

    def save_last(self, *, mid_epoch: bool) -> None:
        """``last.pt``: at an epoch end the loader state is None (the next epoch starts fresh)."""
        loader_state = None
        if mid_epoch:
            # The batches this loop has trained on, not the ones a prefetcher has already drawn.
            loader_state = self.data.train_loader.state_dict(batches_consumed=self.state.batch_in_epoch)
        if self.ctx.is_main:
            save_checkpoint(self.plan.path(rd.LAST_FILE), self.checkpoint_state(loader_state))

    def restore(self, checkpoint: dict[str, Any]) -> None:
        self.model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        self.state = TrainState.from_dict(checkpoint["train_state"])
        self.resumed_loader = checkpoint["loader"]
        if checkpoint["loader"] is not None:
            # Rank 0 saved its loader position; it holds for every rank (each consumes an equal share).
            self.data.train_loader.set_epoch(self.state.epoch)
            self.data.train_loader.load_state_dict(checkpoint["loader"])
        restore_rng_state(checkpoint["rng"])
        log.info("resumed from %s at epoch %d, step %d", self.plan.resume_from, self.state.epoch + 1,
                 self.state.step)

    def batches(self, loader: Any) -> Any:
        """Feature batches come from a background thread; loaders with workers already prefetch."""
        if self.data.kind == "features" and self.data.workers == 0 and self.cfg.prefetch > 0:
            return ThreadPrefetcher(loader, depth=self.cfg.prefetch, pin_memory=self.ctx.device.type == "cuda")
        return loader

    # -- the epochs ------------------------------------------------------------------------------------------
    def after_step(self) -> bool:
        cfg = self.cfg
        if cfg.checkpoint_every and self.state.step % cfg.checkpoint_every == 0 \
                and self.state.batch_in_epoch < len(self.data.train_loader):
            self.save_last(mid_epoch=True)
        return cfg.stop_after_steps is not None and self.state.step >= cfg.stop_after_steps

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.head == "logreg":  # one full-batch fit instead of epochs (train.model.probe_run)
            return fit_probe(self)
        step_ctx = StepContext(self.ddp_model, self.optimizer, self.scheduler, self.scaler, self.loss_fn,
                               self.ctx.device, self.amp, self.data.normalize)
        row: dict[str, Any] = self.state.history[-1] if self.state.history else {}
        first = True  # this process's first batch: the time to first batch of this start or resume
        if self.ctx.is_main:
            self.record_layout()
        self.watch_loaders()
        recorder = KeyRecorder(self.plan.folder, self.ctx.rank) if cfg.record_keys else None
        while self.state.epoch < cfg.epochs:
            if self.state.batch_in_epoch == 0:
                self.data.train_loader.set_epoch(self.state.epoch)
            meter, stopped = run_train_epoch(
                step_ctx, self.fed(self.data.train_loader, recorder), self.state, total_epochs=cfg.epochs,
                quiet=cfg.quiet or not self.ctx.is_main, after_step=self.after_step,
                checkpoint_due=lambda step: bool(cfg.checkpoint_every) and step % cfg.checkpoint_every == 0,
                worker_stages=getattr(self.data.train_loader, "stage_seconds", None),
                on_first_batch=self.first_batch if first else None)
            first = False
            if stopped:
                return self.summary(row, stopped=True)
            row = self.end_epoch(meter)
        self.finish()
        return self.summary(row, stopped=False)

    def record_layout(self) -> None:
        """Rank 0: the layout this start or resume feeds the run in, and the loader state it resumed from, as a
        data event (``shards.data_events``): what ``shards lineage`` rebuilds the run's loaders from."""
        loader, folder = self.data.train_loader, self.plan.folder
        where = {"epoch": self.state.epoch + 1, "step": self.state.step, "rank": 0}
        kept = keep_keys_file(folder, self.cfg.exclude_keys) if self.cfg.exclude_keys else None
        earlier = [e for e in read_events(folder) if e.get("kind") == "layout"]
        if kept is not None and (not earlier or earlier[-1].get("exclude_keys") != kept["keys_file"]):
            append_event(folder, {"kind": "exclude", **where, **kept, "source": self.cfg.exclude_keys})
        append_event(folder, {
            "kind": "layout", **where, "loader_state": self.resumed_loader, "world_size": self.ctx.world_size,
            "num_workers": int(getattr(loader, "num_workers", 0) or 0), "batch_size": self.cfg.batch_size,
            "nodes": int(loader.dataset.config.nodes), "exclude_keys": kept and kept["keys_file"]})

    def watch_loaders(self) -> None:
        """Stall recovery (``--stall-timeout``) writes its stack dumps into the run folder and its restarts and
        quarantines of train samples as data events, stamped with the step whose batch was awaited."""
        def train_event(event: dict[str, Any]) -> None:
            append_event(self.plan.folder, {**event, "epoch": self.state.epoch + 1, "step": self.state.step + 1,
                                            "rank": self.ctx.rank})

        for loader, on_event in ((self.data.train_loader, train_event), (self.data.val_loader, None)):
            if hasattr(loader, "report_faults"):
                loader.report_faults(str(self.plan.folder), on_event)

    def fed(self, loader: Any, recorder: KeyRecorder | None) -> Any:
        """The train batches, through the prefetcher if any, each one's keys recorded (``--record-keys``)."""
        batches = self.batches(loader)
        return batches if recorder is None else recorder.record(batches, self.state)

    def first_batch(self, meter) -> str:
        """Record this start's (or resume's) time to first batch, kept for the epoch's metrics row; the line the
        progress bar shows."""
        record = first_batch_record(
            started=self.started, arrived=time.perf_counter(), open_s=self.data.open_s, wait_s=meter.wait_s,
            worker_seconds=meter.worker_seconds, workers=self.data.workers,
            resume=self.plan.resume_from is not None, epoch=self.state.epoch + 1, step=self.state.step)
        self.state.first_batch.append(record)
        return describe(record)

    def end_epoch(self, meter) -> dict[str, Any]:
        state = self.state
        samples_per_s, wait_share = meter.reduced(self.ctx.device)
        train_sums = torch.tensor([state.loss_sum, float(state.correct), float(state.samples)], dtype=torch.float64,
                                  device=self.ctx.device)
        if self.ctx.distributed:
            torch.distributed.all_reduce(train_sums)
        val_batches = self.batches(self.data.val_loader)
        if self.regression:
            val = evaluate_regression(self.model, val_batches, self.ctx.device, self.loss_fn, self.amp,
                                      self.data.normalize)
        else:
            val = evaluate(self.model, val_batches, self.ctx.device, self.data.classes, self.amp, self.data.normalize)
        row = {"epoch": state.epoch + 1, "step": state.step, "lr": self.optimizer.param_groups[0]["lr"],
               "train_loss": float(train_sums[0] / train_sums[2]), "train_top1": float(train_sums[1] / train_sums[2]),
               "samples_per_s": samples_per_s, "data_wait_share": wait_share, "epoch_time_s": meter.wall_s, **val}
        if self.regression:
            row.pop("train_top1")
        row.update(self.cache_row())
        row["quarantined"] = len(getattr(self.data.train_loader, "quarantined", ()))  # samples kept out so far
        row.update(self.stage_row(meter))
        if self.data.mixture is not None:  # samples each source filled this epoch (fixed by the mixture's draw)
            row["mixture_drawn"] = list(self.data.mixture.draw)
        if len(self.data.classes) > CONFUSION_IN_METRICS_MAX_CLASSES:
            row.pop("val_confusion")
        if state.first_batch:  # the starts and resumes of this epoch (train.run.first_batch), rank 0's numbers
            row["first_batch"], state.first_batch = state.first_batch, []
        state.history.append(row)
        improved = self.track_best(row)
        state.epoch += 1
        state.start_epoch()
        if self.ctx.is_main:
            self.write_epoch_files(row, improved)
            self.log_epoch(row)
        self.ctx.barrier()
        return row

    def track_best(self, row: dict[str, Any]) -> bool:
        """Whether this epoch is the new best.pt: the highest val top-1, or for regression the lowest finite
        val_mse (a diverged epoch's NaN never wins)."""
        state = self.state
        if self.regression:
            mse = row["val_mse"]
            improved = math.isfinite(mse) and (state.best_val_mse is None or mse < state.best_val_mse)
            if improved:
                state.best_val_mse = mse
            return improved
        improved = row["val_top1"] > state.best_val_top1
        state.best_val_top1 = max(state.best_val_top1, row["val_top1"])
        return improved

    def cache_row(self) -> dict[str, Any]:
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
        epoch["ideal_bytes"] = ideal_fetch_bytes(epoch["planned_bytes"], self.cfg.cache_limit, self.ctx.nodes)
        lookups = epoch["hits"] + epoch["misses"]
        return {"cache_hit_rate": epoch["hits"] / lookups if lookups else None, "fetched_bytes": epoch["fetched_bytes"],
                "cache": epoch}

    def stage_row(self, meter) -> dict[str, Any]:
        """Where the epoch's time went: ``stage_seconds`` summed over ranks (worker stages: busy seconds summed over
        each rank's workers; loop stages: wall seconds of each rank's loop) and ``stage_seconds_by_rank``."""
        by_rank = gather_stage_seconds(meter.stage_seconds, self.ctx.device)
        # Under DDP also the slowest rank and every rank's wait and step (shards.report.stragglers).
        return {"stage_seconds": sum_stage_seconds(by_rank), "stage_seconds_by_rank": by_rank,
                **straggler_fields(by_rank)}

    def write_epoch_files(self, row: dict[str, Any], improved: bool) -> None:
        rd.write_metrics(self.plan.path(rd.METRICS_FILE), self.state.history)
        self.save_last(mid_epoch=False)
        if improved:
            copy_checkpoint(self.plan.path(rd.LAST_FILE), self.plan.path(rd.BEST_FILE))
        if self.state.epoch < self.cfg.epochs:  # after the last epoch, finish() draws them once
            self.refresh_views(final=False)

    def refresh_views(self, *, final: bool) -> None:
        """``curves.png`` and ``report.html`` for someone watching the run. Drawing them takes about a second, so
        after short epochs they are redrawn at most every ``VIEW_REFRESH_S`` seconds, and always at the end."""
        now = time.monotonic()
        if not final and now - self._views_at < VIEW_REFRESH_S:
            return
        self._views_at = now
        plot_curves(self.state.history, self.plan.path(rd.CURVES_FILE))
        if not self.cfg.report:
            return
        from shards.report.build import write_run_report

        try:
            write_run_report(self.plan.folder)
        except Exception as exc:  # noqa: BLE001 - a view must never stop the training it reports on
            log.warning("report.html not written: %s", exc)

    def log_epoch(self, row: dict[str, Any]) -> None:
        if self.regression:
            r2 = "n/a" if row["val_r2"] is None else f"{row['val_r2']:.4f}"
            scores = f"val_r2 {r2}, val_mse {row['val_mse']:.4g}, val_mae {row['val_mae']:.4g}"
        else:
            top5 = f", val_top5 {row['val_top5']:.2%}" if "val_top5" in row else ""
            scores = f"val_top1 {row['val_top1']:.2%}{top5}"
        log.info("epoch %d/%d: train_loss %.4f, val_loss %.4f, %s | %.0f samples/s, data wait %.1f%%",
                 row["epoch"], self.cfg.epochs, row["train_loss"], row["val_loss"], scores,
                 row["samples_per_s"], 100 * row["data_wait_share"])
        straggler = row_straggler(row)
        if straggler is not None:
            log.info("epoch %d slowest rank: %s", row["epoch"], straggler.describe())
        warning = run_straggler_warning(self.state.history)
        if warning:
            log.warning(warning)
        if "cache" in row:
            rate = row["cache_hit_rate"]
            log.info("node cache: hit rate %s, fetched %s (the floor: %s), served %s from the cache",
                     "n/a" if rate is None else f"{rate:.0%}", human_bytes(row["fetched_bytes"]),
                     human_bytes(row["cache"]["ideal_bytes"]), human_bytes(row["cache"]["served_bytes"]))
        tip = advice.wait_advice(row["data_wait_share"], row["data_wait_share"] * row["epoch_time_s"],
                                 data_kind=self.data.kind, workers=self.data.workers, stages=row.get("stage_seconds"),
                                 decode=self.cfg.decode, network_reads=reads_over_network(self.cfg, self.data.kind))
        if tip:
            log.warning(tip)

    def finish(self) -> None:
        """``model.pt``: what using the model needs, and nothing that needs this package to load."""
        if not self.ctx.is_main:
            return
        cfg, data = self.cfg, self.data
        payload: dict[str, Any] = {
            "kind": "head" if data.kind == "features" else "image_model",
            "state_dict": self.model.state_dict(), "classes": list(data.classes),
            "head": cfg.head if data.kind == "features" else None,
            "model": cfg.model if data.kind == "images" else None,
            "features_dim": data.features_dim, "hidden_dim": cfg.hidden_dim,
            "feature_config": data.feature_config(),
            "transform": data.eval_transform.to_dict() if data.eval_transform else None,
            "train_config": cfg.to_dict(), "epochs": self.state.epoch, "task": data.task,
            # A mixture: its class map and sources (labels index ``classes``, the union under class_map="union").
            "mixture": data.mixture_record(cfg),
            # Regression: the head predicts (y - mean) / std; a prediction is output * std + mean.
            "target": self.regression_target() if self.regression else None,
        }
        save_checkpoint(self.plan.path(rd.MODEL_FILE), payload)
        self.refresh_views(final=True)

    def regression_target(self) -> dict[str, Any]:
        """What turns the head's output back into the target: the column, its train mean and std, the loss."""
        target = self.data.manifest.config["target"]
        return {"column": target.get("column"), **self.loss_fn.scale.to_dict(), "loss": self.cfg.loss}

    def summary(self, row: dict[str, Any], *, stopped: bool) -> dict[str, Any]:
        scores = ("val_r2", "val_mse", "val_mae") if self.regression else ("val_top1", "val_top5")
        keep = ("epoch", "train_loss", "val_loss", *scores, "samples_per_s", "data_wait_share",
                "cache_hit_rate", "fetched_bytes", "stage_seconds")
        out = {k: row.get(k) for k in keep if k in row}
        out.update({"run_dir": str(self.plan.folder), "data": self.data.kind, "task": self.data.task,
                    "classes": len(self.data.classes), "steps": self.state.step, "stopped": stopped,
                    "world_size": self.ctx.world_size, "device": str(self.ctx.device)})
        if self.regression:
            out["best_val_mse"] = self.state.best_val_mse
            for name in scores:
                out.setdefault(name, None)
        else:
            out["best_val_top1"] = self.state.best_val_top1 if self.state.history else None
            out.setdefault("val_top1", None)
        out.setdefault("data_wait_share", None)
        return out
