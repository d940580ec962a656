"""Where a loader's time goes, by stage: the seconds DataLoader workers spend reading, decoding, transforming and
collating, kept in shared memory so the training loop can tell which stage starves it.

The stage names are a contract (``metrics.jsonl``'s ``stage_seconds``, the report built from it): worker stages
``read`` (getting shard bytes: iterating the shard reader, fetches from object storage or the node cache
included), ``decode`` (bytes to pixels), ``transform`` (crop, resize, augment, to tensor) and ``collate``; loop
stages, measured by the training loop, ``wait``, ``to_device``, ``normalize`` and ``step``.

Worker seconds are busy seconds: the wall time a worker spent inside a stage (so a slow fetch counts as read,
and a worker idle because the loader's queue is full counts nowhere), summed over the workers of a rank. Each
worker adds up its seconds in plain floats and writes them to its own row of a shared block once per batch: one
writer per row needs no lock, so the cost is a few clock reads per sample and four stores per batch.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator, TypeVar

from torch.utils.data import get_worker_info

from shards.procs.values import MAX_WORKERS
from shards.procs.values import SharedValues

T = TypeVar("T")

WORKER_STAGES = ("read", "decode", "transform", "collate")
LOOP_STAGES = ("wait", "to_device", "normalize", "step")
STAGES = WORKER_STAGES + LOOP_STAGES
READ, DECODE, TRANSFORM, COLLATE = range(len(WORKER_STAGES))


def zero_stages(names: Iterable[str] = WORKER_STAGES) -> dict[str, float]:
    return {name: 0.0 for name in names}


_WIDTH = len(WORKER_STAGES)
_ROWS = MAX_WORKERS + 1  # one row per DataLoader worker, the last for the process that iterates without workers


def worker_slot() -> int:
    """The row this process writes: its DataLoader worker id, or the last row outside workers."""
    info = get_worker_info()
    return MAX_WORKERS if info is None else info.id % MAX_WORKERS


class SharedStageTimes(SharedValues):
    """Cumulative worker-stage seconds of one rank: a block of shared doubles with one row per worker, each row
    written by one process only (no lock), summed when read."""

    def __init__(self) -> None:
        super().__init__("d", _ROWS * _WIDTH, lock=False)

    def add(self, slot: int, seconds: list[float]) -> None:
        """Add one worker's pending seconds (in ``WORKER_STAGES`` order) to its row."""
        base = slot * _WIDTH
        for index, value in enumerate(seconds):
            if value:
                self._array[base + index] += value

    def add_one(self, slot: int, stage: int, seconds: float) -> None:
        self._array[slot * _WIDTH + stage] += seconds

    def snapshot(self) -> dict[str, float]:
        values = self._array[:]
        return {name: sum(values[stage::_WIDTH]) for stage, name in enumerate(WORKER_STAGES)}

    def reset(self) -> None:
        """Zero every row; between epochs (a worker adding at the same moment could undo it)."""
        self._array[:] = [0.0] * (_ROWS * _WIDTH)



class StageTally:
    """One worker's seconds not yet written to the shared block: written every ``flush_every`` decoded samples
    (the loader's batch size) and when the worker's stream ends."""

    __slots__ = ("shared", "slot", "pending", "flush_every", "_count")

    def __init__(self, shared: SharedStageTimes, flush_every: int = 1, slot: int | None = None):
        self.shared = shared
        self.slot = worker_slot() if slot is None else slot
        self.pending = [0.0] * len(WORKER_STAGES)
        self.flush_every = max(1, flush_every)
        self._count = 0

    def timed_read(self, items: Iterable[T]) -> Iterator[T]:
        """``items`` unchanged, the time spent producing each counted as read."""
        iterator = iter(items)
        clock = time.perf_counter
        pending = self.pending
        while True:
            began = clock()
            try:
                item = next(iterator)
            except StopIteration:
                pending[READ] += clock() - began
                return
            pending[READ] += clock() - began
            yield item

    def decoded(self, began: float, decoded_at: Any, ended: float) -> None:
        """Split one decoder call at ``decoded_at`` (the decoder's mark of where decoding ended), or count it all as
        decode when the decoder left no mark inside this call (a decoder that does not cooperate)."""
        if isinstance(decoded_at, float) and began <= decoded_at <= ended:
            self.pending[DECODE] += decoded_at - began
            self.pending[TRANSFORM] += ended - decoded_at
        else:
            self.pending[DECODE] += ended - began
        self.sample_done()

    def sample_done(self) -> None:
        self._count += 1
        if self._count >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if any(self.pending):
            self.shared.add(self.slot, self.pending)
            self.pending[:] = [0.0] * len(WORKER_STAGES)
        self._count = 0


class TimedCollate:
    """A ``collate_fn`` whose seconds count as collate; a class, not a closure, so workers can carry it."""

    def __init__(self, collate_fn: Callable, shared: SharedStageTimes):
        self.collate_fn = collate_fn
        self.shared = shared

    def __call__(self, batch: Any) -> Any:
        began = time.perf_counter()
        try:
            return self.collate_fn(batch)
        finally:
            self.shared.add_one(worker_slot(), COLLATE, time.perf_counter() - began)


def stage_delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Seconds per stage between two snapshots of cumulative counters."""
    return {name: max(0.0, now.get(name, 0.0) - before.get(name, 0.0)) for name in now}
