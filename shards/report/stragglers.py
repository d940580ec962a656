"""Which rank held a distributed epoch back, and whether it was waiting for data or computing: one rule for the
training log, ``metrics.jsonl`` and the run report (``shards.report.stages``), so they never disagree.

Under DDP every rank meets the others at each gradient all-reduce, so the slowest rank sets everyone's step time and
the others' extra seconds hide inside their own ``step`` stage (blocked in the all-reduce). A rank's ``wait`` (its
seconds blocked on its own loader) is its own, though: nobody else's slowness shows there. So:

- the **data** straggler is the rank whose wait exceeds the mean of the other ranks' waits by at least
  ``DATA_EXCESS_SHARE`` of its own wait and step seconds;
- otherwise the epoch is bound by **compute** and the rank named is the one with the most step seconds. Since the
  all-reduce evens step times out, this names a rank only as well as the step clocks differ; the useful verdict is
  that no rank's input pipeline holds the others back.

A **warning** (the training log and the report) when the same rank is the data straggler, waits more than
``WARN_RATIO`` times the mean of the others, and waits at least ``WARN_EXCESS_S`` longer than they do (so about as
long as each of them waits for it) in each of ``WARN_EPOCHS`` consecutive epochs: a ratio alone would warn about
milliseconds on short epochs.

Pure functions of per-rank stage seconds (``{stage: seconds}`` per rank, as ``stage_seconds_by_rank``): no torch,
no files. One process has no stragglers: every function answers None for fewer than two ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

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
        """Its ``metrics.jsonl`` fields."""
        return {"slowest_rank": self.rank, "slowest_rank_cause": self.cause, "slowest_rank_wait_s": self.wait_s,
                "others_wait_s": self.others_wait_s, "slowest_rank_wait_ratio": self.wait_ratio}

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
