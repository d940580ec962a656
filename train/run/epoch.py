"""One training epoch and one evaluation pass, with the running sums a resumed epoch continues from."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shards.jobs.progress import progress
from shards.image.side_stream import SideStreamCopy
from train.run.diagnose import WAIT_WARNING_SHARE, dominant_worker_stage
from train.run.meter import DataWaitMeter, MemoryTrace
from train.model.metrics import ClassificationTally
from train.model.models import logits_of
from train.model.regression import RegressionLoss, RegressionTally

POSTFIX_EVERY_S = 0.5


@dataclass
class TrainState:
    """Where the run is. ``epoch`` is the index of the epoch in progress (0-based); ``batch_in_epoch`` counts the
    batches of it already trained on; the sums make a resumed epoch's train loss equal an uninterrupted one's."""

    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0
    best_val_top1: float = -1.0
    best_val_mse: float | None = None  # regression: best.pt is the epoch with the lowest val_mse
    history: list[dict[str, Any]] = field(default_factory=list)
    # Time-to-first-batch records (``train.run.first_batch``) of the starts and resumes in the epoch in progress: kept
    # in mid-epoch checkpoints, moved onto the epoch's metrics row when it ends.
    first_batch: list[dict[str, Any]] = field(default_factory=list)

    def start_epoch(self) -> None:
        self.batch_in_epoch, self.loss_sum, self.correct, self.samples = 0, 0.0, 0, 0

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "batch_in_epoch": self.batch_in_epoch,
                "loss_sum": self.loss_sum, "correct": self.correct, "samples": self.samples,
                "best_val_top1": self.best_val_top1, "best_val_mse": self.best_val_mse,
                "history": list(self.history), "first_batch": list(self.first_batch)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainState":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass
class StepContext:
    """What a training step needs besides the batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    loss_fn: nn.Module
    device: torch.device
    amp: bool
    normalize: nn.Module | None = None


def to_device(batch: Sequence[torch.Tensor], device: torch.device, normalize: nn.Module | None = None,
              meter: DataWaitMeter | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs as float32 (feature caches are float16; the fast image pipeline's uint8 batches are normalised
    here, once per batch on the device) and labels as int64 (regression targets as float32) on the training device.

    With a ``meter``, the copies count as the ``to_device`` stage and the normalisation as ``normalize``: wall
    seconds of this loop, so on CUDA an asynchronous copy counts only what it holds the loop up."""
    inputs, labels = batch[0], batch[1]
    if not isinstance(labels, torch.Tensor):
        labels = torch.as_tensor(labels)
    inputs = inputs.to(device, non_blocking=True)
    if normalize is not None and inputs.dtype == torch.uint8:
        if meter is not None:
            meter.lap("to_device")
        inputs = normalize(inputs)
        if meter is not None:
            meter.lap("normalize")
    if inputs.dtype != torch.float32:
        inputs = inputs.float()
    labels = labels.to(device, dtype=torch.float32 if labels.is_floating_point() else torch.int64,
                       non_blocking=True)
    if meter is not None:
        meter.lap("to_device")
    return inputs, labels


def train_step(ctx: StepContext, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step; returns the detached mean loss and the number of correct predictions (0 for
    regression targets, where nothing is counted as correct)."""
    with torch.autocast(device_type=ctx.device.type, dtype=torch.float16, enabled=ctx.amp):
        logits = logits_of(ctx.model(inputs))
        loss = ctx.loss_fn(logits.float(), labels)
    ctx.optimizer.zero_grad(set_to_none=True)
    ctx.scaler.scale(loss).backward()
    ctx.scaler.step(ctx.optimizer)
    ctx.scaler.update()
    ctx.scheduler.step()
    if labels.is_floating_point():
        return loss.detach(), torch.zeros((), dtype=torch.int64, device=labels.device)
    return loss.detach(), (logits.detach().argmax(dim=1) == labels).sum()


def run_train_epoch(ctx: StepContext, loader: Any, state: TrainState, *, total_epochs: int, quiet: bool,
                    after_step: Callable[[], bool], checkpoint_due: Callable[[int], bool],
                    worker_stages: Callable[[], dict[str, float]] | None = None,
                    on_first_batch: Callable[[DataWaitMeter], str | None] | None = None,
                    memory: MemoryTrace | None = None) -> tuple[DataWaitMeter, bool]:
    """Train on the loader's remaining batches; ``after_step`` may checkpoint and returns True to stop early.

    Loss and accuracy sums stay on the device (no sync per step) and are folded into ``state`` whenever a
    checkpoint is due and at the end, so the grouping of the sums, and so the numbers, do not depend on a resume.
    ``worker_stages`` (the loader's ``stage_seconds``) lets the meter split the epoch's wait by worker stage.
    ``on_first_batch`` is called once, as the first batch arrives (before it is used); a line it returns is
    written above the progress bar. ``memory``: the trace of the loader's memory in flight the meter samples.
    """
    ctx.model.train()
    meter = DataWaitMeter(worker_stages=worker_stages, memory=memory)
    meter.start()
    bar = progress(total=len(loader), initial=state.batch_in_epoch, desc=f"epoch {state.epoch + 1}/{total_epochs}",
                   unit="batch", quiet=quiet)
    sums = torch.zeros(2, dtype=torch.float64, device=ctx.device)  # loss_sum, correct
    side = SideStreamCopy(ctx.device)  # batch n+1's copy and normalisation beside step n (shards.image.side_stream)
    last_postfix = time.perf_counter()
    stopped = False

    def fold() -> None:
        loss_sum, correct = sums.tolist()
        state.loss_sum += loss_sum
        state.correct += int(correct)
        sums.zero_()

    try:
        for batch in meter.iterate(loader):
            if on_first_batch is not None:
                line, on_first_batch = on_first_batch(meter), None
                if line and not quiet:
                    bar.write(line, file=sys.stderr)
            with side.copying():
                inputs, labels = to_device(batch, ctx.device, ctx.normalize, meter)
            side.hand_over(inputs, labels)
            loss, correct = train_step(ctx, inputs, labels)
            count = int(labels.shape[0])
            sums += torch.stack([loss.double() * count, correct.double()])
            meter.lap("step")
            state.samples += count
            state.step += 1
            state.batch_in_epoch += 1
            meter.add_samples(count)
            bar.update(1)
            if not quiet and time.perf_counter() - last_postfix > POSTFIX_EVERY_S:
                last_postfix = time.perf_counter()
                bar.set_postfix(progress_postfix(meter, float(loss)))
            if checkpoint_due(state.step):
                fold()
            if after_step():
                stopped = True
                break
    finally:
        fold()
        meter.stop()
        bar.close()
    return meter, stopped


def progress_postfix(meter: DataWaitMeter, loss: float) -> dict[str, str]:
    """The bar's numbers; while the loop starves, also the worker stage it waits for (``decode 78%``)."""
    postfix = {"loss": f"{loss:.4f}", "samples/s": f"{meter.samples_per_s:,.0f}",
               "data wait": f"{meter.wait_share:.0%}"}
    dominant = dominant_worker_stage(meter.worker_seconds) if meter.wait_share > WAIT_WARNING_SHARE else None
    if dominant is not None:
        postfix["slowest stage"] = f"{dominant[0]} {dominant[1]:.0%}"
    return postfix


@torch.no_grad()
def evaluate(model: nn.Module, loader: Any, device: torch.device, classes: Sequence[str],
             amp: bool, normalize: nn.Module | None = None) -> dict[str, Any]:
    """Loss (plain cross-entropy, no smoothing or weights), top-1/5, per-class accuracy, confusion; all ranks."""
    model.eval()
    tally = ClassificationTally(len(classes), device)
    for batch in loader:
        inputs, labels = to_device(batch, device, normalize)
        with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=amp):
            logits = logits_of(model(inputs)).float()
        tally.update(logits, labels, F.cross_entropy(logits, labels, reduction="sum"))
    tally.all_reduce()
    return tally.result(classes)


@torch.no_grad()
def evaluate_regression(model: nn.Module, loader: Any, device: torch.device, loss_fn: RegressionLoss, amp: bool,
                        normalize: nn.Module | None = None) -> dict[str, Any]:
    """``val_loss`` (the training loss, standardised units), ``val_mse``, ``val_mae``, ``val_r2``; all ranks."""
    model.eval()
    tally = RegressionTally(loss_fn.scale, device)
    for batch in loader:
        inputs, targets = to_device(batch, device, normalize)
        with torch.autocast(device_type=device.type, dtype=torch.float16, enabled=amp):
            outputs = logits_of(model(inputs)).float()
        tally.update(outputs, targets, loss_fn(outputs, targets, reduction="sum"))
    tally.all_reduce()
    return tally.result()
