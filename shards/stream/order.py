"""The order: which rows a worker yields, in which order, as one pure function (docs/design.md, "The order model").

``worker_order(source, layout, epoch, rank, worker)`` is the only definition of the order. Iteration reads its
``rows`` (turned into covering reads) and yields them in its ``positions``; elastic resume replays the same call over
the saved layout to find what every old worker had yielded (``shards.stream.elastic``); the in-process feature
loader takes the same rows and positions as one index array. A stage added to the order (a per-shard filter, a
quarantine list) is added here once, and iteration and replay cannot disagree.

The steps, each a function of (source, layout, epoch, rank, worker) only:
1. the epoch's stream: every row of the epoch in order (``source.epoch_stream``): the shards shuffled from
   ``(seed, epoch)`` and read front to back (``shards.stream.plan``), a mixture's drawn runs
   (``shards.stream.mixture``), or, for an epoch continued in another layout, the rows it had left;
2. the rank's and worker's share of that stream (``plan.share_of``): equal rank blocks, whole-batch worker runs;
3. the positions in which the worker yields its rows: as read (no shuffle), through a seeded shuffle buffer
   (DataLoader workers, bounded memory), or as one full permutation (the in-process feature loader). Class-weighted
   resampling, which needs the labels, sits between reading and step 3 and keeps the count, so positions still
   apply; it is the one label-dependent stage, and a run that uses it resumes in the same layout only.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from shards.stream.plan import STREAM_SHUFFLE_BUFFER, epoch_stream, rng_for, share_of
from shards.stream.stages import shuffle_buffer

T = TypeVar("T")

FULL = -1  # ``WorkerOrder.buffer`` of a loader that permutes a rank's rows whole (``Layout.whole``)


@dataclass(frozen=True)
class EpochSource:
    """What every layout of a run shares: the shard sizes and the order settings of the dataset."""

    shard_sizes: tuple[int, ...]
    seed: int
    shuffle: bool
    shuffle_buffer: int
    drop_last: bool  # the dataset's: equal rank shares by leaving samples out rather than padding
    class_weights: bool
    rotate_every: int = 0  # node affinity's rotation; the node count comes from each layout
    mixture: Any = field(default=None, compare=False)  # a ``Mixture``: its own epoch rows (shards.stream.mixture)

    @classmethod
    def of(cls, config: Any, shard_sizes: Sequence[int], mixture: Any = None) -> EpochSource:
        """From a ``StreamConfig``."""
        return cls(tuple(int(n) for n in shard_sizes), config.seed, config.shuffle, config.shuffle_buffer,
                   config.drop_last, config.class_weights is not None, config.rotate_every, mixture)

    def epoch_stream(self, epoch: int, world_size: int, nodes: int) -> np.ndarray:
        """The epoch's rows in stream order, before rank padding: what a layout deals out."""
        if self.mixture is not None:
            return self.mixture.stream(epoch)
        return epoch_stream(self.shard_sizes, seed=self.seed, epoch=epoch, world_size=world_size,
                            drop_last=self.drop_last, shuffle=self.shuffle, nodes=nodes,
                            rotate_every=self.rotate_every)


@dataclass(frozen=True)
class Layout:
    """How a run's ranks and workers deal an epoch: what may change between a save and its resume.

    ``split_batch`` is the unit of the split between workers (the loader's batch size, so all workers but one yield
    whole batches); ``whole``: the rank's rows are permuted whole (the in-process feature loader), not through each
    worker's shuffle buffer."""

    world_size: int = 1
    nodes: int = 1
    num_workers: int = 1
    split_batch: int = 1
    whole: bool = False

    @classmethod
    def of(cls, state: Any) -> Layout:
        """The layout a ``LoaderState`` was saved in."""
        return cls(state.world_size, state.node_count, state.logical_workers, state.split_batch or 1,
                   whole=state.kind == "feature_batches")


@dataclass(frozen=True)
class WorkerOrder:
    """One worker's epoch: ``rows`` (global row indices, or positions of a replayed stream) in the order they are
    read, and the seeded rule for the order they are yielded in (``positions``)."""

    rows: np.ndarray
    buffer: int  # 0: as read; FULL: one permutation; else a shuffle buffer of this many rows
    seed_parts: tuple[int, ...] = ()

    def positions(self) -> Iterable[int]:
        """Positions into ``rows`` (into the class-weighted read stream, which has as many) in yield order."""
        n = len(self.rows)
        if not self.buffer or not self.seed_parts:
            return range(n)
        rng = rng_for(*self.seed_parts)
        if self.buffer == FULL:
            return rng.permutation(n)
        return shuffle_buffer(range(n), self.buffer, rng)

    def arrange(self, items: Iterable[T]) -> Iterator[T]:
        """``items`` (read in ``rows`` order) in yield order; holds only what was read before its turn."""
        if not self.buffer or not self.seed_parts:
            return iter(items)
        return in_positions(items, self.positions())

    def served(self, rows: np.ndarray | None = None) -> np.ndarray:
        """``rows`` (default: this order's, or a class-weighted resample of them) as one array in yield order."""
        rows = self.rows if rows is None else rows
        return rows[np.fromiter(self.positions(), dtype=np.int64, count=len(rows))] if len(rows) else rows

    def yielded(self, count: int) -> np.ndarray:
        """The first ``count`` rows this worker yields."""
        count = min(count, len(self.rows))
        if count == 0:
            return self.rows[:0]
        first = np.fromiter(itertools.islice(self.positions(), count), dtype=np.int64, count=count)
        return self.rows[first]


def worker_order(source: EpochSource, layout: Layout, epoch: int, rank: int, worker: int = 0,
                 stream: np.ndarray | None = None) -> WorkerOrder:
    """Which rows ``worker`` of ``rank`` yields in ``epoch``, in which order (see the module docstring).

    ``stream``: the epoch's rows when they are not the source's own (an epoch continued in another layout, or a
    replay over stream positions)."""
    if stream is None:
        stream = source.epoch_stream(epoch, layout.world_size, layout.nodes)
    rows = share_of(stream, rank=rank, world_size=layout.world_size, worker=worker, num_workers=layout.num_workers,
                    drop_last=source.drop_last, batch_size=layout.split_batch)
    buffer = 0 if not source.shuffle else FULL if layout.whole else source.shuffle_buffer
    # The in-process loader draws from worker 0's generator, so a rank's order depends on (seed, epoch, rank) only.
    return WorkerOrder(rows, buffer, (source.seed, STREAM_SHUFFLE_BUFFER, epoch, rank, worker))


def in_positions(items: Iterable[T], positions: Iterable[int]) -> Iterator[T]:
    """Yield ``items`` in the order ``positions`` names them, reading ahead only as far as the next one needs."""
    source = iter(items)
    pending: dict[int, T] = {}
    read = 0
    for position in positions:
        while position >= read:
            pending[read] = next(source)
            read += 1
        yield pending.pop(position)
