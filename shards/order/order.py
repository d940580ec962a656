"""The order: which rows a worker yields, in which order, as one pure function (docs/design.md, "The order model").

``worker_order(source, layout, epoch, rank, worker)`` is the only definition of the order. Iteration reads its
``rows`` (turned into covering reads) and yields them in its ``positions``; elastic resume replays the same call over
the saved layout to find what every old worker had yielded (``shards.position.elastic``); the in-process feature
loader takes the same rows and positions as one index array. A stage added to the order (a per-shard filter, a
quarantine list) is added here once, and iteration and replay cannot disagree.

The steps, each a function of (source, layout, epoch, rank, worker) only:
1. the epoch's stream: every row of the epoch in order (``source.epoch_stream``): the shards shuffled from
   ``(seed, epoch)`` and read front to back (``shards.order.plan``), a mixture's drawn runs
   (``shards.select.mixture``), or, for an epoch continued in another layout, the rows it had left; with class
   weights, that stream resampled by each row's class weight (``shards.order.weights``: as many draws, in stream
   order, a row drawn twice listed twice), so every step below, and every replay, sees the draws as rows;
2. the rank's and worker's share of that stream (``plan.share_of``): equal rank blocks, whole-batch worker runs;
3. the positions in which the worker yields its rows: as read (no shuffle), through a seeded shuffle buffer
   (DataLoader workers, bounded memory), or as one full permutation (the in-process feature loader).
   The in-process loader's permutation may be windowed (``EpochSource.feature_window``): rows permuted within
   consecutive windows of that many positions of the rank's share, which reads the shuffled shards front to back,
   so one window touches a few shards and the loader can read the next window's shards while this one trains
   (MosaicML streaming's ``py1b``: the shard order shuffled, then samples shuffled within fixed-size blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from shards.errors import InputError
from shards.order.plan import STREAM_SHUFFLE_BUFFER, epoch_stream, rng_for, share_of
from shards.order.weights import weighted_stream

T = TypeVar("T")

FULL = -1  # ``WorkerOrder.buffer`` of a loader that permutes a rank's rows whole (``Layout.whole``)
DRAW_BLOCK = 1024  # the shuffle buffer draws its random numbers in blocks of this many (part of the order)
CHUNK_BLOCKS = 64  # blocks of draws turned into positions at once: bounded memory, few numpy calls


@dataclass(frozen=True)
class EpochSource:
    """What every layout of a run shares: the shard sizes and the order settings of the dataset."""

    shard_sizes: tuple[int, ...]
    seed: int
    shuffle: bool
    shuffle_buffer: int
    drop_last: bool  # the dataset's: equal rank shares by leaving samples out rather than padding
    class_weights: tuple[float, ...] | None  # one weight per class (None: no class weighting)
    rotate_every: int = 0  # node affinity's rotation; the node count comes from each layout
    feature_window: int = 0  # the in-process loader permutes within windows of this many rows (0: whole)
    mixture: Any = field(default=None, compare=False)  # a ``Mixture``: its own epoch rows (shards.select.mixture)
    # Sorted global rows left out of every epoch (``ShardDataset.exclude_rows``): the rest keep their order.
    excluded: Any = field(default=None, compare=False)
    # Each global row's class (``shards.select.labels``), which class weighting draws by; None without weights.
    labels: Any = field(default=None, compare=False)

    @classmethod
    def of(cls, config: Any, shard_sizes: Sequence[int], mixture: Any = None, excluded: Any = None,
           labels: Any = None) -> EpochSource:
        """From a ``StreamConfig``."""
        weights = None if config.class_weights is None else tuple(float(w) for w in config.class_weights)
        return cls(tuple(int(n) for n in shard_sizes), config.seed, config.shuffle, config.shuffle_buffer,
                   config.drop_last, weights, config.rotate_every, config.feature_window, mixture, excluded, labels)

    def epoch_stream(self, epoch: int, world_size: int, nodes: int) -> np.ndarray:
        """The epoch's rows in stream order, before rank padding: what a layout deals out (with class weights, the
        weighted draws)."""
        rows = self._rows(epoch, world_size, nodes)
        if not self.class_weights:
            return rows
        if self.labels is None:
            raise InputError("class weighting draws by each sample's label, and this dataset was given none: open "
                             "it with shards.open_dataset(sampling=Sampling(class_weights=...))")
        return weighted_stream(rows, self.labels, self.class_weights, seed=self.seed, epoch=epoch)

    def _rows(self, epoch: int, world_size: int, nodes: int) -> np.ndarray:
        if self.mixture is not None:
            return self.mixture.stream(epoch)
        if self.excluded is not None:  # the stream without them; the dealing (``share_of``) balances the ranks
            rows = epoch_stream(self.shard_sizes, seed=self.seed, epoch=epoch, world_size=world_size,
                                shuffle=self.shuffle, nodes=nodes, rotate_every=self.rotate_every)
            return rows[~np.isin(rows, self.excluded)]
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
    read, and the seeded rule for the order they are yielded in (``positions``); or, for the rest of an order
    after a resumed worker's skip (``after``), those positions themselves (``given``)."""

    rows: np.ndarray
    buffer: int  # 0: as read; FULL: one permutation; else a shuffle buffer of this many rows
    seed_parts: tuple[int, ...] = ()
    window: int = 0  # with FULL: permuted within consecutive windows of this many positions (0: whole)
    given: np.ndarray | None = field(default=None, compare=False)  # the positions, when not drawn by the rule

    @property
    def as_read(self) -> bool:
        return self.given is None and (not self.buffer or not self.seed_parts or self.buffer == 1)

    def position_chunks(self) -> Iterator[np.ndarray]:
        """Positions into ``rows`` in yield order, as consecutive arrays computed only as far as they are asked
        for: a replay of a worker's first rows costs those rows, not the worker's epoch."""
        n = len(self.rows)
        if self.given is not None:
            return iter([self.given])
        if self.as_read:
            return iter([np.arange(n, dtype=np.int64)])
        rng = rng_for(*self.seed_parts)
        if self.buffer == FULL:
            return iter([windowed_permutation(n, self.window, rng) if self.window else rng.permutation(n)])
        return buffer_positions(n, self.buffer, rng)

    def positions(self) -> np.ndarray:
        """All positions in yield order, as one array."""
        return np.concatenate([np.zeros(0, dtype=np.int64), *self.position_chunks()])

    def arrange(self, items: Iterable[T]) -> Iterator[T]:
        """``items`` (read in ``rows`` order) in yield order; holds only what was read before its turn."""
        if self.as_read:
            return iter(items)
        return in_positions(items, (p for chunk in self.position_chunks() for p in chunk.tolist()))

    def served(self) -> np.ndarray:
        """This order's rows as one array in yield order."""
        return self.rows[self.positions()] if len(self.rows) else self.rows

    def yielded(self, count: int) -> np.ndarray:
        """The first ``count`` rows this worker yields."""
        count = min(count, len(self.rows))
        chunks, have = [np.zeros(0, dtype=np.int64)], 0
        for chunk in self.position_chunks() if count else ():
            chunks.append(chunk)
            have += len(chunk)
            if have >= count:
                break
        return self.rows[np.concatenate(chunks)[:count]]

    def after(self, skip: int) -> WorkerOrder:
        """This order without its first ``skip`` yields: the rows still to come, in read order, and their yield
        order. A resumed worker reads these rather than reading ``skip`` samples to drop them (at ImageNet size,
        late in an epoch, that was minutes of reads before the first batch). A class-weighted order too: its rows are
        the draws, known before anything is read."""
        if skip <= 0:
            return self
        if self.as_read:
            return replace(self, rows=self.rows[skip:])
        rest = self.positions()[skip:]
        kept = np.sort(rest)
        return replace(self, rows=self.rows[kept], given=np.searchsorted(kept, rest))


def worker_order(source: EpochSource, layout: Layout, epoch: int, rank: int, worker: int = 0,
                 stream: np.ndarray | None = None) -> WorkerOrder:
    """Which rows ``worker`` of ``rank`` yields in ``epoch``, in which order (see the module docstring).

    ``stream``: the epoch's rows when they are not the source's own (an epoch continued in another layout, or a
    replay over stream positions): taken as they are, since they come from a stream already weighted."""
    if stream is None:
        stream = source.epoch_stream(epoch, layout.world_size, layout.nodes)
    rows = share_of(stream, rank=rank, world_size=layout.world_size, worker=worker, num_workers=layout.num_workers,
                    drop_last=source.drop_last, batch_size=layout.split_batch)
    buffer = 0 if not source.shuffle else FULL if layout.whole else source.shuffle_buffer
    # The in-process loader draws from worker 0's generator, so a rank's order depends on (seed, epoch, rank) only.
    return WorkerOrder(rows, buffer, (source.seed, STREAM_SHUFFLE_BUFFER, epoch, rank, worker),
                       window=source.feature_window if layout.whole else 0)


def windowed_permutation(n: int, window: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of ``range(n)`` that keeps each position in its window of ``window`` consecutive positions
    (the last one shorter): window ``k`` yields exactly positions ``[k * window, (k + 1) * window)``, shuffled."""
    return np.lexsort((rng.random(n), np.arange(n, dtype=np.int64) // window)).astype(np.int64)


def buffer_positions(n: int, size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """The yield order of a reservoir-style shuffle buffer of ``size`` over ``n`` items, as positions, in chunks.

    The rule (the order itself, which saved states depend on): fill the buffer with the first ``size`` items; for
    each further item draw ``u`` (uniform, in blocks of ``DRAW_BLOCK``), emit the item in slot ``int(u * size)``
    and put the new item there; at the end emit the buffer in ``rng.permutation(len(buffer))`` order. The order
    never looks at the items, so it is index arithmetic: the item emitted at step ``t`` is the one last put in its
    slot, the step before it that drew the same slot (a stable sort by slot finds it) or, for a slot's first draw
    of a chunk, whatever ``owner`` says the slot held when the chunk began."""
    size = min(size, n)
    steps = n - size
    draws = -(-steps // DRAW_BLOCK) * DRAW_BLOCK  # the draws the rule takes before its final permutation
    owner = np.arange(size, dtype=np.int64)  # the item in each slot
    chunk = DRAW_BLOCK * CHUNK_BLOCKS
    for start in range(0, steps, chunk):
        block = rng.random(min(chunk, draws - start))[:steps - start]
        slots = (block * size).astype(np.int64)
        # Steps grouped by slot, in step order within a slot; 16-bit keys get numpy's radix sort (several times faster).
        keys = slots.astype(np.uint16) if size <= 1 << 16 else slots
        by_slot = np.argsort(keys, kind="stable")
        grouped = slots[by_slot]
        first = np.ones(len(grouped), dtype=bool)
        first[1:] = grouped[1:] != grouped[:-1]
        emitted = np.empty(len(slots), dtype=np.int64)
        emitted[by_slot[first]] = owner[grouped[first]]
        emitted[by_slot[~first]] = by_slot[np.flatnonzero(~first) - 1] + start + size  # put there one draw before
        last = np.ones(len(grouped), dtype=bool)
        last[:-1] = first[1:]
        owner[grouped[last]] = by_slot[last] + start + size
        yield emitted
    yield owner[rng.permutation(size)]


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
