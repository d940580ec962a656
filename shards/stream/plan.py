"""The epoch plan: which slices of which shards one DataLoader worker of one rank reads, as a pure function.

Everything that decides sample order lives here and depends only on (shard sizes, seed, epoch, rank, world size,
worker, number of workers), so it can be tested as properties and recomputed anywhere (a resumed run, a worker
process, the main process counting batches) without talking to anyone.

The epoch is one virtual stream: the shards in an order shuffled from ``(seed, epoch)``, each read front to back.
Ranks take equal contiguous blocks of it; when the total does not divide by the world size, the stream is padded by
repeating its first samples (as ``DistributedSampler`` does) or, with ``drop_last``, the last samples of the
manifest order are left out of every epoch (the same few samples each time, so the loss is fixed and reportable).
Each rank's block is split into contiguous runs for its workers in whole batches: every worker but one holds a
multiple of the batch size (the batch counts differ by at most one), and the one holds the rank's remainder, so a
rank has at most one partial batch (``drop_last`` loses fewer than ``batch_size`` samples per rank). With a batch
size of 1 (a dataset iterated without a loader) the runs differ by at most one sample.

The same split applies to any ordered list of global sample indices (``share_of``): a resume in another layout
deals the samples an interrupted epoch had left (``shards.stream.elastic``) exactly as a whole epoch is dealt.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from shards.errors import InputError

# Separate random streams for separate purposes, so adding one never shifts another.
STREAM_SHARD_ORDER = 1
STREAM_SHUFFLE_BUFFER = 2
STREAM_CLASS_WEIGHTS = 3
STREAM_TRANSFORM = 4


class ShardSlice(NamedTuple):
    """Samples ``start:stop`` (manifest order within the shard) of shard number ``shard``."""

    shard: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class EpochSizes:
    """How an epoch's samples divide over ranks: ``per_rank * world_size == total - dropped + padded``."""

    total: int
    world_size: int
    per_rank: int
    padded: int
    dropped: int


def epoch_sizes(total: int, world_size: int = 1, drop_last: bool = False) -> EpochSizes:
    if world_size < 1:
        raise InputError(f"world_size must be at least 1, got {world_size}")
    if total < 0:
        raise InputError(f"a split cannot hold {total} samples")
    if drop_last:
        per_rank = total // world_size
    else:
        per_rank = -(-total // world_size)
    used = per_rank * world_size
    return EpochSizes(total, world_size, per_rank, max(0, used - total), max(0, total - used))


def worker_sample_counts(per_rank: int, num_workers: int, batch_size: int = 1) -> list[int]:
    """Samples each worker of a rank yields (the same for every rank), in whole batches of ``batch_size``.

    The rank's whole batches are dealt out as evenly as possible (earlier workers get the extra ones) and the
    remainder, fewer than ``batch_size`` samples, goes to the first worker with the smaller batch count, which
    keeps the workers within one batch of each other. ``batch_size=1`` is the plain split (sizes within one).
    """
    if num_workers < 1 or batch_size < 1:
        raise InputError(f"num_workers and batch_size must be at least 1, got {num_workers} and {batch_size}")
    batches, remainder = divmod(per_rank, batch_size)
    base, extra = divmod(batches, num_workers)
    counts = [(base + (1 if w < extra else 0)) * batch_size for w in range(num_workers)]
    counts[extra] += remainder
    return counts


def worker_range(per_rank: int, worker: int, num_workers: int, batch_size: int = 1) -> tuple[int, int]:
    """The ``[start, stop)`` offsets of ``worker``'s run inside its rank's block (see ``worker_sample_counts``)."""
    if not 0 <= worker < num_workers:
        raise InputError(f"worker {worker} is outside 0..{num_workers - 1}")
    counts = worker_sample_counts(per_rank, num_workers, batch_size)
    start = sum(counts[:worker])
    return start, start + counts[worker]


def rng_for(seed: int, *parts: int) -> np.random.Generator:
    """A generator seeded from explicit integers only (never ``hash()``, time or pid)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF] + [int(p) & 0xFFFFFFFFFFFFFFFF for p in parts])


def shard_order(num_shards: int, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    if not shuffle:
        return list(range(num_shards))
    return [int(i) for i in rng_for(seed, STREAM_SHARD_ORDER, epoch).permutation(num_shards)]


def _trimmed_sizes(shard_sizes: Sequence[int], dropped: int) -> list[int]:
    """Leave out the last ``dropped`` samples of the manifest order (the same ones every epoch)."""
    sizes = list(shard_sizes)
    index = len(sizes) - 1
    while dropped > 0 and index >= 0:
        cut = min(dropped, sizes[index])
        sizes[index] -= cut
        dropped -= cut
        index -= 1
    return sizes


def plan_epoch(
    shard_sizes: Sequence[int],
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    drop_last: bool = False,
    shuffle: bool = True,
    batch_size: int = 1,
) -> list[ShardSlice]:
    """The ordered slices ``worker`` of ``rank`` reads this epoch (before any shuffle buffer); ``batch_size`` is
    the unit of the split between workers (the loader's batch size)."""
    if not 0 <= rank < world_size:
        raise InputError(f"rank {rank} is outside 0..{world_size - 1}")
    if any(size < 0 for size in shard_sizes):
        raise InputError(f"shard sizes must be non-negative, got {list(shard_sizes)}")
    sizes = epoch_sizes(sum(shard_sizes), world_size, drop_last)
    usable = _trimmed_sizes(shard_sizes, sizes.dropped)
    order = [i for i in shard_order(len(usable), seed=seed, epoch=epoch, shuffle=shuffle) if usable[i] > 0]
    start, stop = worker_range(sizes.per_rank, worker, num_workers, batch_size)
    offset = rank * sizes.per_rank
    return _positions_to_slices([usable[i] for i in order], order, offset + start, offset + stop)


def _positions_to_slices(ordered_sizes: list[int], order: list[int], first: int, last: int) -> list[ShardSlice]:
    """Map positions ``[first, last)`` of the (cyclically padded) epoch stream to shard slices."""
    total = sum(ordered_sizes)
    if total == 0 or first >= last:
        return []
    ends = np.cumsum(ordered_sizes).tolist()
    slices: list[ShardSlice] = []
    position = first
    while position < last:
        local = position % total
        k = bisect.bisect_right(ends, local)
        shard_begin = ends[k] - ordered_sizes[k]
        take = min(last - position, ends[k] - local)
        slices.append(ShardSlice(order[k], local - shard_begin, local - shard_begin + take))
        position += take
    return slices


def epoch_stream(shard_sizes: Sequence[int], *, seed: int, epoch: int, world_size: int = 1,
                 drop_last: bool = False, shuffle: bool = True) -> np.ndarray:
    """The epoch's virtual stream as global sample indices (the manifest's running count), before padding: what
    ``plan_epoch`` deals out, as one array."""
    sizes = epoch_sizes(sum(shard_sizes), world_size, drop_last)
    usable = _trimmed_sizes(shard_sizes, sizes.dropped)
    offsets = shard_offsets(shard_sizes)
    order = shard_order(len(usable), seed=seed, epoch=epoch, shuffle=shuffle)
    pieces = [np.arange(offsets[i], offsets[i] + usable[i], dtype=np.int64) for i in order if usable[i] > 0]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def share_of(stream: np.ndarray, *, rank: int, world_size: int, worker: int = 0, num_workers: int = 1,
             drop_last: bool = False, batch_size: int = 1) -> np.ndarray:
    """The part of an ordered index ``stream`` that ``worker`` of ``rank`` reads, dealt out as ``plan_epoch``
    deals an epoch: equal contiguous rank blocks (padded by repeating the stream's first entries, or with
    ``drop_last`` its last entries left out), then whole-batch worker runs."""
    if not 0 <= rank < world_size:
        raise InputError(f"rank {rank} is outside 0..{world_size - 1}")
    sizes = epoch_sizes(len(stream), world_size, drop_last)
    start, stop = worker_range(sizes.per_rank, worker, num_workers, batch_size)
    offset = rank * sizes.per_rank
    if len(stream) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(stream, dtype=np.int64)[np.arange(offset + start, offset + stop) % len(stream)]


def shard_offsets(shard_sizes: Sequence[int]) -> np.ndarray:
    """The global index of each shard's first sample, and the total at the end."""
    return np.concatenate([[0], np.cumsum(shard_sizes, dtype=np.int64)]).astype(np.int64)


def slices_to_indices(slices: Sequence[ShardSlice], offsets: np.ndarray) -> np.ndarray:
    pieces = [np.arange(offsets[p.shard] + p.start, offsets[p.shard] + p.stop, dtype=np.int64) for p in slices]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


def indices_to_slices(indices: np.ndarray, offsets: np.ndarray) -> list[ShardSlice]:
    """Global indices, in order, as the fewest shard slices that read them in that order (runs of neighbours)."""
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) == 0:
        return []
    shards = np.searchsorted(offsets, indices, side="right") - 1
    breaks = np.flatnonzero((np.diff(indices) != 1) | (np.diff(shards) != 0)) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(indices)]])
    local = indices - offsets[shards]
    return [ShardSlice(int(shards[a]), int(local[a]), int(local[b - 1]) + 1)
            for a, b in zip(starts.tolist(), stops.tolist())]


def round_robin_consumed(batches_per_worker: Sequence[int], consumed: int) -> tuple[list[int], int]:
    """Replay DataLoader's in-order round robin: per-worker batches taken after ``consumed`` batches, and the
    worker whose batch comes next.

    A DataLoader over an ``IterableDataset`` asks its workers for batches in turn and skips a worker once it is
    exhausted, so the main process can tell, from the count alone, how far every worker got.
    """
    remaining = list(batches_per_worker)
    taken = [0] * len(remaining)
    if consumed > sum(remaining):
        raise InputError(f"{consumed} batches consumed, but the epoch has only {sum(remaining)}")
    pointer = 0
    workers = len(remaining)
    while consumed > 0:
        active = [w for w in range(workers) if remaining[w] > 0]
        if pointer > active[-1]:
            pointer = 0  # the cycle wraps past finished workers back to the first active one
        full_rounds = min(consumed // len(active), min(remaining[w] for w in active))
        if full_rounds > 0 and pointer <= active[0]:
            for w in active:
                remaining[w] -= full_rounds
                taken[w] += full_rounds
            consumed -= full_rounds * len(active)
            continue
        w = pointer
        while remaining[w] == 0:
            w = (w + 1) % workers
        remaining[w] -= 1
        taken[w] += 1
        consumed -= 1
        pointer = (w + 1) % workers
    if not any(remaining):
        return taken, 0
    next_worker = pointer
    while remaining[next_worker] == 0:
        next_worker = (next_worker + 1) % workers
    return taken, next_worker
