"""The rules the training loop applies to its own numbers, and records as findings (docs/design.md, "Runs").

After each epoch the loop asks two questions and writes the answers into the epoch's ``metrics.jsonl`` row
(``shards.runrecord.EpochRow``: ``wait_advice``, ``straggler``, ``straggler_warning``); the training log prints them
and the run report shows them as recorded, so the two never disagree and the report never applies a rule of its own.

**Did the input pipeline hold the epoch back, and what to change.**

- The verdict (``starving``): the loop waited for data more than ``WAIT_WARNING_SHARE`` of the epoch AND at least
  ``WAIT_WARNING_SECONDS``. A share alone misleads on short epochs: a 0.1 s epoch spends most of its time starting
  its workers, and "60% waiting" there is 60 ms no setting gives back.
- The advice names the stage the workers spend most of their time in (read, decode, transform, collate: the stage
  names of ``shards.procs.stage_times``) and what usually fixes it. A node-local cache (``--cache-dir``) or a local
  copy is suggested only when image shards are read over the network every epoch and not cached
  (``reads_over_network``): local files are local already, feature rows stay in memory after their first read,
  ``--cache-images`` keeps decoded images in memory and ``--cache-dir`` already caches.

**Which rank held a distributed epoch back, and whether it waited for data or computed.** Under DDP every rank
meets the others at each gradient all-reduce, so the slowest rank sets everyone's step time and the others' extra
seconds hide inside their own ``step`` stage. A rank's ``wait`` (its seconds blocked on its own loader) is its own:

- the **data** straggler is the rank whose wait exceeds the mean of the other ranks' waits by at least
  ``DATA_EXCESS_SHARE`` of its own wait and step seconds;
- otherwise the epoch is bound by **compute** and the rank named is the one with the most step seconds (the
  all-reduce evens step times out, so this names a rank only as well as the step clocks differ).

A **warning** when the same rank is the data straggler, waits more than ``WARN_RATIO`` times the mean of the
others, and waits at least ``WARN_EXCESS_S`` longer than they do in each of ``WARN_EPOCHS`` consecutive epochs: a
ratio alone would warn about milliseconds on short epochs. One process has no stragglers.

**What a person should conclude from the epoch** (``verdicts``, recorded as ``EpochRow.verdicts``; the run report
opens with them). Each is ``{"rule", "level", "text"}``, level ``bad``, ``warn`` or ``good``:

- ``accuracy``: val top-1 at chance, the share a model that ignores its input gets by always answering the most
  common val class, within ``CHANCE_SIGMAS`` standard errors over the val images (so a tiny val split does not
  call a lucky guess learning); else how far above it.
- ``one_class``: at least ``ONE_CLASS_SHARE`` of the val images predicted as one class (read from the confusion
  matrix, recorded up to 64 classes): a collapsed model, usually a learning rate too high.
- ``loss_at_chance``: train and val loss within ``LOSS_AT_CHANCE_TOLERANCE`` of ln C, the cross-entropy of a
  uniform guess (class weights and label smoothing leave it there): the outputs do not depend on the input.
  A loss that is not finite is ``diverged``.
- ``data``: the pipeline is the bottleneck (``starving``), and how much faster an epoch that never waited would be;
  or it is not. No verdict on an epoch shorter than ``WAIT_WARNING_SECONDS``: its wait is start-up no setting
  removes, and "53% waiting" of 10 ms concludes nothing.

Pure functions of numbers and flags (no tensors, no files), so they are tested on numbers alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from shards.procs.stage_times import LOOP_STAGES, WORKER_STAGES
from shards.transport.location import locate

WAIT_WARNING_SHARE = 0.20
# The wait must also be material in absolute time. Below this, an epoch has at most a second or two to gain from any
# change, and its wait is mostly one-off start-up that no setting removes (forking workers, opening the first
# shards, filling the first batch: tens of milliseconds to about a second). A pipeline that really starves the
# loop waits longer than this within any epoch worth tuning.
WAIT_WARNING_SECONDS = 2.0
# Copying batches to the device above this share of the loop's time is worth a tip of its own.
TO_DEVICE_WARNING_SHARE = 0.10


def starving(share: float, wait_s: float) -> bool:
    """Whether an epoch that waited ``wait_s`` seconds for data, ``share`` of its wall time, was held back by its
    input pipeline: both over ``WAIT_WARNING_SHARE`` and at least ``WAIT_WARNING_SECONDS``."""
    return share > WAIT_WARNING_SHARE and wait_s >= WAIT_WARNING_SECONDS


def reads_over_network(data_kind: str | None, paths: Iterable[str], *, cache_images: bool,
                       cache_dir: str | None) -> bool:
    """Whether every epoch reads image shards over the network (``s3://``, ``http(s)://``, ``pipe:``) uncached: the
    one case where a node-local cache or a local copy helps."""
    return data_kind == "images" and not cache_images and not cache_dir and any(
        locate(p).local_path() is None for p in paths)


def dominant_worker_stage(stages: Mapping[str, float] | None) -> tuple[str, float] | None:
    """The worker stage with the most seconds and its share of all worker seconds; None without worker time."""
    if not stages:
        return None
    total = sum(stages.get(name, 0.0) for name in WORKER_STAGES)
    if total <= 0:
        return None
    name = max(WORKER_STAGES, key=lambda stage: stages.get(stage, 0.0))
    return name, stages[name] / total


def _more_workers(workers: int | None) -> str:
    return "add workers (--workers" + ("" if workers is None else f", now {workers}") + ")"


def _stage_tip(stage: str, *, workers: int | None, decode: str | None, network_reads: bool) -> str:
    more_workers = _more_workers(workers)
    if stage == "read":
        if network_reads:
            return ("the shards come slowly over the network: use --cache-dir on node-local disk, or copy the shards "
                    "to a local disk")
        return f"reading is slow: {more_workers}"  # local (or in-memory) data: a cache or a copy changes nothing
    if stage == "collate":
        fewer_bytes = "" if decode == "fast" else "use --decode fast (uint8 batches, a quarter of the bytes), "
        return f"batches are slow to assemble: {fewer_bytes}{more_workers} or a smaller --batch-size"
    fast = "" if decode == "fast" else ", use --decode fast"  # decode or transform: more hands, less work
    return f"{more_workers}{fast}, or train on cached features (precompute-features, then train on the feature folder)"


def stage_advice(stages: Mapping[str, Any], *, workers: int | None, decode: str | None = None,
                 network_reads: bool = False) -> list[str]:
    """The stage-specific tips: the largest worker stage with its share, and copying to the device when large."""
    tips = []
    dominant = dominant_worker_stage(stages)
    if dominant is not None:
        name, share = dominant
        tip = _stage_tip(name, workers=workers, decode=decode, network_reads=network_reads)
        tips.append(f"{name} is {share:.0%} of worker time: {tip}")
    loop_total = sum(stages.get(name, 0.0) for name in LOOP_STAGES)
    if loop_total > 0 and stages.get("to_device", 0.0) / loop_total > TO_DEVICE_WARNING_SHARE:
        tips.append(f"to_device is {stages['to_device'] / loop_total:.0%} of the loop's time: use pin_memory / a GPU "
                    "node")
    return tips


def wait_advice(share: float, wait_s: float, *, data_kind: str | None, workers: int | None,
                stages: Mapping[str, Any] | None = None, decode: str | None = None,
                network_reads: bool = False) -> str | None:
    """What to change when the loop starves (``starving``); ``None`` when the data pipeline keeps up.

    ``wait_s``: the epoch's seconds blocked on data, ``share`` their share of its wall time. With ``stages`` (an
    epoch's ``stage_seconds``) the advice names the stage the workers spend most time in; without worker seconds
    it falls back to the tips that usually help for ``data_kind`` ("images", "features", None when unknown).
    ``network_reads`` (``reads_over_network``): only then are a node-local cache and a local copy suggested.
    ``workers``: None when not known (the report of a run that chose its workers itself).
    """
    if not starving(share, wait_s):
        return None
    waited = (f"the training loop waited for data {wait_s:.1f} s, {share:.0%} of the epoch (over "
              f"{WAIT_WARNING_SHARE:.0%} and {WAIT_WARNING_SECONDS:g} s): the data pipeline is the bottleneck")
    tips = stage_advice(stages, workers=workers, decode=decode, network_reads=network_reads) if stages else []
    if tips and dominant_worker_stage(stages) is not None:
        if data_kind == "features":
            tips.append("a larger --batch-size (per-batch overhead dominates a small head)")
        return f"{waited}: " + "; ".join(tips)
    if data_kind != "features":
        tips.append("more --workers" + ("" if workers is None else f" (now {workers})"))
    if data_kind == "images":
        tips.append("train on precomputed features instead of images (precompute-features, then train on the feature folder)")
        tips.append("fast JPEG decode at reduced size, or repack with smaller images")
        if network_reads:
            tips.append("--cache-dir on node-local disk, or copy the shards to a local disk")
    if data_kind == "features":
        tips.append("a larger --batch-size (per-batch overhead dominates a small head)")
    return f"{waited}; try: " + "; ".join(tips)


DATA_EXCESS_SHARE = 0.10  # extra wait over the others' mean, as a share of the rank's wait + step: "data"
WARN_RATIO = 2.0
WARN_EPOCHS = 2
WARN_EXCESS_S = 1.0  # seconds per epoch the others lose to the straggler before it is worth a warning


@dataclass(frozen=True)
class Straggler:
    """The slowest rank of one epoch: its wait and step seconds against the mean of the other ranks'."""

    rank: int
    cause: str  # "data" or "compute"
    wait_s: float
    others_wait_s: float  # mean over the other ranks
    step_s: float
    others_step_s: float

    @property
    def excess_wait_s(self) -> float:
        """Seconds this rank waited for data beyond the others' mean: about what each other rank lost to it."""
        return self.wait_s - self.others_wait_s

    @property
    def wait_ratio(self) -> float | None:
        """Its wait over the others' mean wait; None when the others never waited."""
        return self.wait_s / self.others_wait_s if self.others_wait_s > 0 else None

    def waits_over(self, ratio: float) -> bool:
        """Whether it waited more than ``ratio`` times the others' mean (always, when they never waited and it did)."""
        return self.wait_s > ratio * self.others_wait_s if self.others_wait_s > 0 else self.wait_s > 0

    def fields(self) -> dict[str, Any]:
        """Its ``metrics.jsonl`` fields (``EpochRow``), its description among them."""
        return {"slowest_rank": self.rank, "slowest_rank_cause": self.cause, "slowest_rank_wait_s": self.wait_s,
                "others_wait_s": self.others_wait_s, "slowest_rank_wait_ratio": self.wait_ratio,
                "slowest_rank_step_s": self.step_s, "others_step_s": self.others_step_s, "straggler": self.describe()}

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> "Straggler | None":
        """The straggler an epoch row recorded (a resumed run's history is rows), or None."""
        if row.get("slowest_rank") is None:
            return None
        return cls(row["slowest_rank"], row["slowest_rank_cause"], row["slowest_rank_wait_s"], row["others_wait_s"],
                   row["slowest_rank_step_s"], row["others_step_s"])

    def describe(self) -> str:
        """One line: ``rank 1 (data): waited 3.6 s for data, 12.0x the other ranks' mean of 0.3 s``."""
        ratio = self.wait_ratio
        times = "while the others did not wait" if ratio is None else f"{ratio:.1f}x the other ranks' mean of " \
                                                                       f"{self.others_wait_s:.2f} s"
        if self.cause == "data":
            return f"rank {self.rank} (data): waited {self.wait_s:.2f} s for data, {times}"
        return (f"rank {self.rank} (compute): step {self.step_s:.2f} s against the other ranks' mean of "
                f"{self.others_step_s:.2f} s; no rank's data wait stands out (its own: {self.wait_s:.2f} s)")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def slowest_rank(ranks: Sequence[Mapping[str, float]]) -> Straggler | None:
    """The epoch's straggler from each rank's stage seconds (rank order), or None for fewer than two ranks."""
    if len(ranks) < 2:
        return None
    waits = [float(rank.get("wait", 0.0)) for rank in ranks]
    steps = [float(rank.get("step", 0.0)) for rank in ranks]

    def others(values: list[float], index: int) -> float:
        return _mean(values[:index] + values[index + 1:])

    waiter = max(range(len(ranks)), key=lambda i: (waits[i] - others(waits, i), -i))
    loop = waits[waiter] + steps[waiter]
    excess = waits[waiter] - others(waits, waiter)
    if loop > 0 and excess >= DATA_EXCESS_SHARE * loop:
        rank, cause = waiter, "data"
    else:
        rank, cause = max(range(len(ranks)), key=lambda i: (steps[i], -i)), "compute"
    return Straggler(rank, cause, waits[rank], others(waits, rank), steps[rank], others(steps, rank))


def sustained_straggler(epochs: Sequence[Straggler | None]) -> Straggler | None:
    """The last epoch's straggler when it is worth a warning: the same rank, waiting for data more than
    ``WARN_RATIO`` times the others' mean and at least ``WARN_EXCESS_S`` more than them, in each of the last
    ``WARN_EPOCHS`` epochs (``epochs`` in order, None for an epoch without per-rank seconds)."""
    recent = list(epochs[-WARN_EPOCHS:])
    if len(recent) < WARN_EPOCHS or any(s is None for s in recent):
        return None
    last = recent[-1]
    for straggler in recent:
        if straggler.rank != last.rank or straggler.cause != "data" or not straggler.waits_over(WARN_RATIO) \
                or straggler.excess_wait_s < WARN_EXCESS_S:
            return None
    return last


def straggler_warning(straggler: Straggler) -> str:
    """The warning for a sustained straggler (``sustained_straggler``)."""
    return (f"rank {straggler.rank} has waited for data more than {WARN_RATIO:g}x the other ranks' mean for "
            f"{WARN_EPOCHS} epochs ({straggler.describe()}); every rank waits for it at each gradient all-reduce: "
            "look at that rank's node (its disk, network, CPU share, --workers)")


def straggler_fields(ranks: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """An epoch's straggler fields: the slowest rank's, and every rank's ``rank_wait_s`` and ``rank_step_s`` in
    rank order; nothing for one process."""
    straggler = slowest_rank(ranks)
    if straggler is None:
        return {}
    return {**straggler.fields(), "rank_wait_s": [float(rank.get("wait", 0.0)) for rank in ranks],
            "rank_step_s": [float(rank.get("step", 0.0)) for rank in ranks]}


def run_straggler_warning(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The warning for a rank that held the others back for data over the last epochs of ``rows`` (the run's
    history, this epoch's row last), or None."""
    straggler = sustained_straggler([Straggler.of_row(row) for row in rows])
    return None if straggler is None else straggler_warning(straggler)


CHANCE_SIGMAS = 3.0  # standard errors over the val images: 61 images at 25% chance allow up to 42%
ONE_CLASS_SHARE = 0.95
LOSS_AT_CHANCE_TOLERANCE = 0.02  # of ln C


def _verdict(rule: str, level: str, text: str) -> dict[str, str]:
    return {"rule": rule, "level": level, "text": text}


def _confusion(fields: Mapping[str, Any]) -> list[list[float]] | None:
    matrix = fields.get("val_confusion")
    if not isinstance(matrix, list) or not matrix or any(not isinstance(r, list) or len(r) != len(matrix)
                                                         for r in matrix):
        return None
    return matrix


def accuracy_verdict(top1: float, samples: int, classes: int, majority_share: float | None = None) -> dict[str, str]:
    """Val top-1 against chance: ``majority_share`` (the most common val class's share), else 1/C."""
    chance = max(majority_share or 0.0, 1.0 / classes)
    margin = CHANCE_SIGMAS * math.sqrt(chance * (1 - chance) / max(samples, 1))
    if top1 <= chance + margin:
        return _verdict("accuracy", "bad", (
            f"val top-1 {top1:.1%} is at chance level ({chance:.1%} by always answering the most common class, within "
            f"{CHANCE_SIGMAS:g} standard errors over {samples:,} val images): the model learnt nothing that carries to "
            "val; check that labels match the inputs (shards inspect), the learning rate, and the features (shards "
            "report FEATURES_DIR)"))
    return _verdict("accuracy", "good", f"val top-1 {top1:.1%} is above chance ({chance:.1%}): the model learns")


def one_class_verdict(matrix: Sequence[Sequence[float]], names: Sequence[str] | None, lr: float | None
                      ) -> dict[str, str] | None:
    """A model that answers one class for (nearly) every val image; None otherwise."""
    predicted = [sum(row[j] for row in matrix) for j in range(len(matrix))]
    total = sum(predicted)
    top = max(range(len(predicted)), key=lambda j: predicted[j])
    if len(matrix) < 2 or total <= 0 or predicted[top] < ONE_CLASS_SHARE * total:
        return None
    name = names[top] if names is not None and len(names) == len(matrix) else f"class {top}"
    now = "" if lr is None else f", set to {lr:.3g}"
    return _verdict("one_class", "bad", (
        f"the model predicts {name!r} for {predicted[top]:,.0f} of {total:,.0f} val images ({predicted[top] / total:.0%}): "
        f"it has collapsed to one class; usually the learning rate is too high (lower --lr{now}) or the classes "
        "are very unbalanced (--balanced-sampler, --class-weighted-loss)"))


def loss_verdict(train_loss: float | None, val_loss: float | None, classes: int) -> dict[str, str] | None:
    """A loss that is not finite, or train and val loss both at ln C; None otherwise."""
    losses = [loss for loss in (train_loss, val_loss) if loss is not None]
    if any(not math.isfinite(loss) for loss in losses):
        return _verdict("diverged", "bad", "the loss is not finite: training diverged; lower --lr, or --amp off")
    if classes < 2:
        return None
    chance = math.log(classes)
    if len(losses) < 2 or any(abs(loss - chance) > LOSS_AT_CHANCE_TOLERANCE * chance for loss in losses):
        return None
    return _verdict("loss_at_chance", "bad", (
        f"train loss {losses[0]:.4f} and val loss {losses[1]:.4f} sit at ln {classes} = {chance:.4f}, the loss of a "
        "uniform guess: the outputs do not depend on the input (degenerate inputs, labels unrelated to them, or a "
        "learning rate too small to move)"))


def data_verdict(share: float | None, epoch_s: float | None) -> dict[str, str] | None:
    """Whether the input pipeline held the epoch back, and by how much; None for an epoch too short to say."""
    if share is None or epoch_s is None or epoch_s < WAIT_WARNING_SECONDS:
        return None
    wait_s = share * epoch_s
    if starving(share, wait_s):
        speedup = epoch_s / max(epoch_s - wait_s, 1e-9)
        return _verdict("data", "bad", (
            f"the data pipeline is the bottleneck: the loop waited {wait_s:.1f} s of the {epoch_s:.1f} s epoch "
            f"({share:.0%}); a pipeline that kept up would make the epoch up to {speedup:.1f}x faster"))
    return _verdict("data", "good", (
        f"the data pipeline is not the bottleneck: the loop waited {wait_s:.1f} s of the {epoch_s:.1f} s epoch "
        f"({share:.0%}); the model's compute sets the pace"))


def verdicts(fields: Mapping[str, Any], classes: int, *, lr: float | None = None) -> list[dict[str, str]]:
    """What the epoch row ``fields`` lets a person conclude, worst first (``classes``: 0 for regression; ``lr``:
    the configured learning rate, which the advice names; the row's own is where a schedule has taken it)."""
    found = []
    matrix = _confusion(fields)
    if classes >= 2 and isinstance(fields.get("val_top1"), (int, float)) and fields.get("val_samples"):
        majority = None
        if matrix is not None and len(matrix) == classes:
            true_counts = [sum(row) for row in matrix]
            majority = max(true_counts) / sum(true_counts) if sum(true_counts) else None
        found.append(accuracy_verdict(fields["val_top1"], fields["val_samples"], classes, majority))
    if classes >= 2 and matrix is not None:
        per_class = fields.get("val_per_class_accuracy")
        names = list(per_class) if isinstance(per_class, Mapping) else None
        found.append(one_class_verdict(matrix, names, lr))
    found.append(loss_verdict(fields.get("train_loss"), fields.get("val_loss"), classes))
    found.append(data_verdict(fields.get("data_wait_share"), fields.get("epoch_time_s")))
    order = {"bad": 0, "warn": 1, "good": 2}
    return sorted((v for v in found if v is not None), key=lambda v: order[v["level"]])
