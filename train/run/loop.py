"""``train(cfg) -> dict``: the training run from manifest to ``model.pt``, in one process or under torchrun.

Order of work: check the input (manifest, freshness, splits), join the process group, decide what the run folder
allows, build loaders, model and optimizer, restore a checkpoint, then epochs of train + validate + checkpoint.
Every rank computes; rank 0 alone logs and writes. ``Run`` holds the run's parts and the order of the epochs; each
concern is a part of its own: the task (``train.run.task``), checkpoints (``train.run.checkpoint``), the epoch rows
and their findings (``train.run.rows``), the data events (``train.run.lineage``) and the views (``train.run.plot``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shards.jobs.preemption import StopRequest
from shards.runrecord import LAST_FILE, METRICS_FILE, MODEL_FILE, EpochRow, RunRecord, write_rows
from train.config import TrainConfig
from train.data import RunData, build_data, describe_batch, prepare_manifest
from train.distributed import DistContext, setup_distributed, wrap_model
from train.model.models import build_head, build_image_model, check_image_model, uses_channels_last
from train.model.optim import build_optimizer, build_scheduler
from train.run.probe_run import fit_probe, prepare_features
from train.model.standardize import FeatureScale
from train.prefetch import ThreadPrefetcher
from train.run import run_dir as rd
from train.run.checkpoint import Checkpoints, load_checkpoint, save_checkpoint
from train.run.epoch import StepContext, TrainState, run_train_epoch
from train.run.first_batch import describe, first_batch_record
from train.run.lineage import DataWatch
from train.run.meter import MemoryTrace
from train.run.preempt import StopVote, preempted
from train.run.plot import Views
from train.run.rows import EpochRows
from train.run.task import make_task

log = logging.getLogger("shardcache.train")


def train(cfg: TrainConfig, *, started: float | None = None, stop: StopRequest | None = None) -> dict[str, Any]:
    """Train as ``cfg`` says; return the summary (last and best val top-1, or val R², MSE and MAE for regression;
    throughput, data-wait share, run dir).

    ``started``: the ``time.perf_counter()`` the time to first batch counts from (``train.run.first_batch``; the CLI
    passes its entry), else this call. ``stop``: the CLI's stop signals (``shards.jobs.preemption``); once it is
    set, the run saves its exact position in ``last.pt`` after the step in flight and raises ``Preempted``."""
    started = time.perf_counter() if started is None else started
    manifest = prepare_manifest(cfg)
    if manifest.kind == "images":
        check_image_model(cfg.model.name, cfg.model.weights)
    plan = None if cfg.run.dry_run else rd.plan_run(cfg)
    ctx = setup_distributed(cfg.run.device)
    if not ctx.is_main:
        logging.getLogger("shardcache").setLevel(logging.WARNING)  # one voice per job: rank 0's
    data: RunData | None = None
    try:
        if cfg.optim.amp and ctx.device.type != "cuda":
            log.warning("--amp needs CUDA; training in float32 on %s", ctx.device)
        data = build_data(cfg, manifest, ctx)
        scale = prepare_features(cfg, data)  # standardising and --head logreg: checked and measured before writing
        if plan is None:
            return dry_run(cfg, data)
        ctx.barrier()  # every rank has judged the folder before rank 0 writes into it
        if ctx.is_main:
            rd.start_run(plan, cfg, mixture=data.mixture_record(cfg), scale=None if scale is None else scale.to_dict(),
                         record=RunRecord(data.train_call, cfg.optim.epochs, data.memory_budget))
        ctx.barrier()
        return Run(cfg, ctx, data, plan, started, scale, stop).fit()
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


def build_model(cfg: TrainConfig, data: RunData, outputs: int, scale: FeatureScale | None = None) -> nn.Module:
    if data.kind == "features":
        return build_head(cfg.model.head, data.features_dim, outputs, hidden_dim=cfg.model.hidden_dim,
                          dropout=cfg.model.dropout, scale=scale)
    return build_image_model(cfg.model.name, outputs, weights=cfg.model.weights)


@dataclass
class Run:
    cfg: TrainConfig
    ctx: DistContext
    data: RunData
    plan: rd.RunPlan
    started: float  # the perf_counter the time to first batch counts from
    scale: FeatureScale | None = None  # the train split's feature mean and std, when standardising
    stop: StopRequest | None = None  # set by a stop signal (train.run.preempt)

    def __post_init__(self) -> None:
        cfg, device = self.cfg, self.ctx.device
        self.amp = cfg.optim.amp and device.type == "cuda"
        self.task = make_task(cfg, self.data, device)
        torch.manual_seed(cfg.optim.seed)  # the same initial weights on every rank and every rerun
        layout = torch.channels_last if uses_channels_last(device.type, self.data.kind) else torch.preserve_format
        self.model = build_model(cfg, self.data, self.task.outputs, self.scale).to(device, memory_format=layout)
        self.optimizer = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, self.optimizer, len(self.data.train_loader))
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp)
        self.state = TrainState()
        self.checkpoints = Checkpoints(self)
        self.rows = EpochRows(cfg, self.ctx, self.data, self.task)
        self.watch = DataWatch(self)
        self.views = Views(self.plan.folder, cfg.run.report)
        # The loader state this start resumed from: its layout event says so (shards lineage).
        self.resumed_loader: dict[str, Any] | None = None
        if self.plan.resume_from is not None:
            self.resumed_loader = self.checkpoints.restore(load_checkpoint(self.plan.resume_from))
        self.ddp_model = wrap_model(self.model, self.ctx)
        self.vote = StopVote(self.stop, self.ctx)  # every rank, in the same order: it may make a process group
        self.saved_at: int | None = None  # the step of the last mid-epoch last.pt

    def batches(self, loader: Any) -> Any:
        """Feature batches come from a background thread; loaders with workers already prefetch."""
        if self.data.kind == "features" and self.data.workers == 0 and self.cfg.loader.prefetch > 0:
            depth = loader.prefetch_within_budget(self.cfg.loader.prefetch)  # beside the loader's own flight
            return ThreadPrefetcher(loader, depth=depth, pin_memory=self.ctx.device.type == "cuda")
        return loader

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        if cfg.model.head == "logreg":  # one full-batch fit instead of epochs (train.run.probe_run)
            return fit_probe(self)
        step_ctx = StepContext(self.ddp_model, self.optimizer, self.scheduler, self.scaler, self.task.loss_fn,
                               self.ctx.device, self.amp, self.data.normalize)
        row: dict[str, Any] = self.state.history[-1] if self.state.history else {}
        first = True  # this process's first batch: the time to first batch of this start or resume
        if self.ctx.is_main:
            self.watch.record_layout(self.resumed_loader)
        self.watch.watch_loaders()
        recorder = self.watch.recorder()
        train_loader = self.data.train_loader
        try:
            while self.state.epoch < cfg.optim.epochs:
                if self.state.batch_in_epoch == 0:
                    train_loader.set_epoch(self.state.epoch)
                batches = self.batches(train_loader)
                meter, stopped = run_train_epoch(
                    step_ctx, batches if recorder is None else recorder.record(batches, self.state), self.state,
                    total_epochs=cfg.optim.epochs, quiet=cfg.run.quiet or not self.ctx.is_main,
                    after_step=self.after_step,
                    checkpoint_due=lambda step: bool(cfg.run.checkpoint_every) and step % cfg.run.checkpoint_every == 0,
                    worker_stages=train_loader.stage_seconds, on_first_batch=self.first_batch if first else None,
                    memory=MemoryTrace() if self.ctx.is_main else None)  # rank 0's, as its row says
                first = False
                if stopped and self.vote.decided:
                    self.save_and_stop(mid_epoch=True)
                if stopped:
                    return self.summary(row, stopped=True)
                row = self.end_epoch(meter)
                if self.state.epoch < cfg.optim.epochs and self.vote.agree():
                    self.save_and_stop(mid_epoch=False)  # the epoch's last.pt is written: the next starts fresh
        finally:
            self.vote.close()
        self.finish()
        return self.summary(row, stopped=False)

    def after_step(self) -> bool:
        """A mid-epoch ``last.pt`` when one is due; True to stop (``stop_after_steps``, or a stop signal the ranks
        agreed on, unless the epoch has no batch left: then it stops after the epoch's end)."""
        cfg = self.cfg
        in_epoch = self.state.batch_in_epoch < len(self.data.train_loader)
        if cfg.run.checkpoint_every and self.state.step % cfg.run.checkpoint_every == 0 and in_epoch:
            self.checkpoints.save_last(mid_epoch=True)
            self.saved_at = self.state.step
        if self.vote.poll() and in_epoch:
            return True
        return cfg.run.stop_after_steps is not None and self.state.step >= cfg.run.stop_after_steps

    def save_and_stop(self, *, mid_epoch: bool) -> None:
        """After a stop signal: the exact position in ``last.pt`` (unless this step's is written), then
        ``Preempted``, on every rank once rank 0 has saved."""
        if mid_epoch and self.saved_at != self.state.step:
            self.checkpoints.save_last(mid_epoch=True)
        self.ctx.barrier()
        raise preempted(self.vote, self.state, len(self.data.train_loader), self.ctx.world_size,
                        str(self.plan.path(LAST_FILE)), self.ctx.is_main)

    def first_batch(self, meter: Any) -> str:
        """Record this start's (or resume's) time to first batch, kept for the epoch's row; the line the progress
        bar shows."""
        record = first_batch_record(
            started=self.started, arrived=time.perf_counter(), open_s=self.data.open_s, wait_s=meter.wait_s,
            worker_seconds=meter.worker_seconds, workers=self.data.workers,
            resume=self.plan.resume_from is not None, epoch=self.state.epoch + 1, step=self.state.step)
        self.state.first_batch.append(record)
        return describe(record)

    def end_epoch(self, meter: Any) -> dict[str, Any]:
        """Validate, record the epoch's row (all ranks build it), then rank 0 writes and logs it."""
        state = self.state
        self.rows.train_done()  # the storage the epoch's train reads used, before validation reads more
        val = self.task.evaluate(self.model, self.batches(self.data.val_loader), self.ctx.device, self.amp,
                                 self.data.normalize)
        row = self.rows.row(state, meter, self.optimizer.param_groups[0]["lr"], val)
        fields = row.to_json()
        state.history.append(fields)
        improved = self.task.improved(state, fields)
        state.epoch += 1
        state.start_epoch()
        if self.ctx.is_main:
            self.write_epoch(improved)
            self.rows.log(row)
        self.ctx.barrier()
        return fields

    def write_epoch(self, improved: bool) -> None:
        """Rank 0: ``metrics.jsonl`` rewritten from the history, the checkpoints, and the views when due (after the
        last epoch, ``finish`` draws them)."""
        write_rows(self.plan.path(METRICS_FILE), self.history_rows())
        self.checkpoints.save_epoch(improved)
        if self.state.epoch < self.cfg.optim.epochs:
            self.views.refresh(self.state.history, final=False)

    def history_rows(self) -> list[EpochRow]:
        return [EpochRow(**fields) for fields in self.state.history]

    def finish(self) -> None:
        """``model.pt``: what using the model needs, and nothing that needs this package to load."""
        if not self.ctx.is_main:
            return
        cfg, data = self.cfg, self.data
        payload: dict[str, Any] = {
            "kind": "head" if data.kind == "features" else "image_model",
            "state_dict": self.model.state_dict(), "classes": list(data.classes),
            "head": cfg.model.head if data.kind == "features" else None,
            "model": cfg.model.name if data.kind == "images" else None,
            "features_dim": data.features_dim, "hidden_dim": cfg.model.hidden_dim,
            "feature_config": data.feature_config(),
            "transform": data.eval_transform.to_dict() if data.eval_transform else None,
            "train_config": cfg.to_dict(), "epochs": self.state.epoch, "task": data.task,
            # A mixture: its class map and sources (labels index ``classes``, the union under class_map="union").
            "mixture": data.mixture_record(cfg),
            "target": self.task.target(),  # regression: what turns the head's output into a prediction
        }
        save_checkpoint(self.plan.path(MODEL_FILE), payload)
        self.views.refresh(self.state.history, final=True)

    def summary(self, row: dict[str, Any], *, stopped: bool) -> dict[str, Any]:
        keep = ("epoch", "train_loss", "val_loss", *self.task.scores, "samples_per_s", "data_wait_share",
                "cache_hit_rate", "fetched_bytes", "stage_seconds")
        out = {k: row.get(k) for k in keep if k in row}
        out.update({"run_dir": str(self.plan.folder), "data": self.data.kind, "task": self.data.task,
                    "classes": len(self.data.classes), "steps": self.state.step, "stopped": stopped,
                    "world_size": self.ctx.world_size, "device": str(self.ctx.device), **self.task.best(self.state)})
        for name in (*self.task.always_scored, "data_wait_share"):
            out.setdefault(name, None)
        return out
