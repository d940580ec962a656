"""The epoch plan: which slices of which shards one DataLoader worker of one rank reads, as a pure function.

Everything that decides sample order lives here and depends only on (shard sizes, seed, epoch, rank, world size,
worker, number of workers, node affinity), so it can be tested as properties and recomputed anywhere (a resumed
run, a worker process, the main process counting batches) without talking to anyone.

The epoch is one virtual stream: the shards in an order shuffled from ``(seed, epoch)``, each read front to back.
Ranks take equal contiguous blocks of it; when the total does not divide by the world size, the stream is padded by
repeating its first samples (as ``DistributedSampler`` does) or, with ``drop_last``, the last samples of the
manifest order are left out of every epoch (the same few samples each time, so the loss is fixed and reportable).
Each rank's block is split into contiguous runs for its workers in whole batches: every worker but one holds a
multiple of the batch size (the batch counts differ by at most one), and the one holds the rank's remainder, so a
rank has at most one partial batch (``drop_last`` loses fewer than ``batch_size`` samples per rank). With a batch
size of 1 (a dataset iterated without a loader) the runs differ by at most one sample.

Node affinity (``nodes > 1``, after MosaicML streaming's node-aware shuffle): a node-local shard cache that cannot
hold the whole dataset misses on nearly every shard when a global shuffle sends each shard to a random node every
epoch. So the shards are first dealt to nodes by a seeded, size-balanced partition that stays fixed for
``rotate_every`` epochs (0: for the whole run), each node's shards are shuffled per epoch, and the stream is node 0's
shards, then node 1's... Ranks are numbered node by node (torchrun, Slurm), so node ``n``'s ranks, which take the
``n``-th run of equal contiguous blocks, read node ``n``'s shards, except a shard straddling a node's block boundary
(the partition aims each node's samples at its block, so that is rare when shard sizes vary) and the padding, which
repeats the stream's first samples. One node is exactly the plain shuffle. A rank's stream is as clustered as before
(whole shards front to back either way); what affinity costs is that, between rotations, a node's ranks see only
the node's shards, while the ranks of all nodes together still cover every shard each epoch.

The same split applies to any ordered list of global sample indices (``share_of``): a resume in another layout
deals the samples an interrupted epoch had left (``shards.position.elastic``) exactly as a whole epoch is dealt.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from shards.errors import InputError

# Separate random streams for separate purposes, so adding one never shifts another.
STREAM_SHARD_ORDER = 1
STREAM_SHUFFLE_BUFFER = 2
STREAM_CLASS_WEIGHTS = 3
STREAM_TRANSFORM = 4
STREAM_AFFINITY = 5
STREAM_MIX_DRAW = 6  # which shards a source's fractional share of an epoch reads (shards.select.mixture)
STREAM_MIX_ORDER = 7  # the order of a mixture's shard runs within an epoch
# Sub-streams of STREAM_AFFINITY, so that the partition of one rotation group and the shard order inside one node
# never draw from the same seed (numpy pads short seed lists with zeros: (5, g) would collide with (5, g, 0)).
_AFFINITY_PARTITION = 0
_AFFINITY_NODE_ORDER = 1
# Swaps per node when balancing the node partition: each one strictly helps, and a few close most gaps.
_BALANCE_ROUNDS = 4


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


def shard_order(num_shards: int, *, seed: int, epoch: int, shuffle: bool = True, nodes: int = 1,
                rotate_every: int = 0, shard_sizes: Sequence[int] | None = None,
                node_block: int | None = None) -> list[int]:
    """The epoch's shard order; with ``nodes > 1``, node by node (``node_shards``), so that each node's ranks keep
    reading the shards its cache holds. ``shard_sizes`` balances the nodes by samples (default: by shard count)."""
    if not shuffle:
        return list(range(num_shards))
    if nodes == 1:  # exactly the order of runs before node affinity: saved states depend on it
        return [int(i) for i in rng_for(seed, STREAM_SHARD_ORDER, epoch).permutation(num_shards)]
    sizes = [1] * num_shards if shard_sizes is None else list(shard_sizes)
    if len(sizes) != num_shards:
        raise InputError(f"shard_sizes has {len(sizes)} entries for {num_shards} shards")
    order: list[int] = []
    dealt = node_shards(sizes, seed=seed, epoch=epoch, nodes=nodes, rotate_every=rotate_every, node_block=node_block)
    for node, shards in enumerate(dealt):
        permutation = rng_for(seed, STREAM_AFFINITY, _AFFINITY_NODE_ORDER, epoch, node).permutation(len(shards))
        order += [shards[int(i)] for i in permutation]
    return order


def affinity_group(epoch: int, rotate_every: int) -> int:
    """The rotation group of ``epoch``: epochs of one group share the node partition (0 = never rotate)."""
    if rotate_every < 0:
        raise InputError(f"rotate_every must be non-negative (0: never rotate), got {rotate_every}")
    return 0 if rotate_every == 0 else epoch // rotate_every


def node_shards(shard_sizes: Sequence[int], *, seed: int, epoch: int, nodes: int, rotate_every: int = 0,
                node_block: int | None = None) -> list[list[int]]:
    """Which shards each node reads in ``epoch``'s rotation group (ascending), as a size-balanced partition.

    Node ``n``'s ranks read stream positions ``[n * node_block, (n + 1) * node_block)`` (the last node's run is
    shorter by the padding); a shard whose samples cross such a boundary is read by two nodes, so the partition aims
    at filling each node's run exactly (without ``node_block``: equal shares). The shards, in a permutation drawn
    from (seed, group), are dealt one by one to the node furthest below its aim, which gets within one shard size
    of it; a few swaps between the most over- and under-filled nodes then close most of the gap when shard sizes
    vary (shards cut by bytes). The seeded deal is what rotates: sorting by size first would deal every group alike.
    """
    if nodes < 1:
        raise InputError(f"nodes must be at least 1, got {nodes}")
    group = affinity_group(epoch, rotate_every)
    total = int(sum(shard_sizes))
    if node_block is None:
        aims = [total * (n + 1) // nodes - total * n // nodes for n in range(nodes)]
    else:
        aims = [min(max(total - n * node_block, 0), node_block) for n in range(nodes)]
    dealt: list[list[int]] = [[] for _ in range(nodes)]
    below = [(-aim, node) for node, aim in enumerate(aims)]  # (filled - aim, node): the heap's top is furthest below
    for shard in rng_for(seed, STREAM_AFFINITY, _AFFINITY_PARTITION, group).permutation(len(shard_sizes)):
        gap, node = heapq.heappop(below)
        dealt[node].append(int(shard))
        heapq.heappush(below, (gap + int(shard_sizes[shard]), node))
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    for _ in range(_BALANCE_ROUNDS * nodes):
        if not _swap_towards_aims(dealt, sizes, aims):
            break
    return [sorted(shards) for shards in dealt]


def _swap_towards_aims(dealt: list[list[int]], sizes: np.ndarray, aims: list[int]) -> bool:
    """Move one shard, or swap two, between the most over- and the most under-filled node when that brings both
    closer to their aims; False when no such move helps (or every node is on its aim)."""
    gaps = [int(sizes[shards].sum()) - aim for shards, aim in zip(dealt, aims)]
    over, under = gaps.index(max(gaps)), gaps.index(min(gaps))
    excess, lack = gaps[over], -gaps[under]
    if excess <= 0 or lack <= 0:
        return False
    ours, theirs = sizes[dealt[over]], sizes[dealt[under]]
    by_size = np.argsort(theirs, kind="stable")
    sorted_theirs = np.concatenate([[0], theirs[by_size]])  # 0: move a shard without taking one back
    best = (excess + lack, -1, -1)  # (error after, our position, their sorted position + 1)
    wanted = ours - min(excess, lack)
    near = np.searchsorted(sorted_theirs, wanted)
    for candidate in (near - 1, near, np.zeros_like(near)):
        candidate = np.clip(candidate, 0, len(sorted_theirs) - 1)
        moved = ours - sorted_theirs[candidate]
        error = np.abs(excess - moved) + np.abs(lack - moved)
        mine = int(np.argmin(error))
        if error[mine] < best[0]:
            best = (int(error[mine]), mine, int(candidate[mine]))
    if best[1] < 0:
        return False
    _, mine, theirs_at = best
    shard = dealt[over].pop(mine)
    dealt[under].append(shard)
    if theirs_at > 0:
        dealt[over].append(dealt[under].pop(int(by_size[theirs_at - 1])))
    return True


def check_nodes(nodes: int, world_size: int, rotate_every: int = 0) -> None:
    """Node affinity assumes whole nodes of equally many ranks, numbered node by node."""
    if nodes < 1 or world_size % nodes:
        raise InputError(f"nodes must be at least 1 and divide world_size={world_size} (ranks are numbered node by "
                         f"node, each node running world_size // nodes of them), got nodes={nodes}")
    if rotate_every < 0:
        raise InputError(f"rotate_every must be non-negative (0: never rotate), got {rotate_every}")


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
    nodes: int = 1,
    rotate_every: int = 0,
) -> list[ShardSlice]:
    """The ordered slices ``worker`` of ``rank`` reads this epoch (before any shuffle buffer): ``share_of`` the
    ``epoch_stream``, as slices. ``batch_size`` is the unit of the split between workers (the loader's batch size);
    ``nodes`` and ``rotate_every`` give the shard order node affinity (``shard_order``)."""
    if any(size < 0 for size in shard_sizes):
        raise InputError(f"shard sizes must be non-negative, got {list(shard_sizes)}")
    stream = epoch_stream(shard_sizes, seed=seed, epoch=epoch, world_size=world_size, drop_last=drop_last,
                          shuffle=shuffle, nodes=nodes, rotate_every=rotate_every)
    rows = share_of(stream, rank=rank, world_size=world_size, worker=worker, num_workers=num_workers,
                    drop_last=drop_last, batch_size=batch_size)
    return indices_to_slices(rows, shard_offsets(shard_sizes))


def epoch_stream(shard_sizes: Sequence[int], *, seed: int, epoch: int, world_size: int = 1,
                 drop_last: bool = False, shuffle: bool = True, nodes: int = 1, rotate_every: int = 0) -> np.ndarray:
    """The epoch's virtual stream as global sample indices (the manifest's running count), before padding: what
    ``plan_epoch`` deals out, as one array."""
    check_nodes(nodes, world_size, rotate_every)
    sizes = epoch_sizes(sum(shard_sizes), world_size, drop_last)
    usable = _trimmed_sizes(shard_sizes, sizes.dropped)
    offsets = shard_offsets(shard_sizes)
    order = shard_order(len(usable), seed=seed, epoch=epoch, shuffle=shuffle, nodes=nodes, rotate_every=rotate_every,
                        shard_sizes=usable, node_block=sizes.per_rank * (world_size // nodes))
    order = np.asarray(order, dtype=np.int64)
    return runs_to_rows(offsets[order], np.asarray(usable, dtype=np.int64)[order])


def runs_to_rows(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The rows of consecutive runs ``[start, start + length)``, in order, as one array (one numpy pass, not one
    array per run: an epoch of 10k+ shards is built at every start and resume)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    shift = np.repeat(np.asarray(starts, dtype=np.int64) - (ends - lengths), lengths)
    return np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.int64) + shift


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
    stream = np.asarray(stream, dtype=np.int64)
    if offset + stop <= len(stream):  # no padding in this share: a plain slice (copied: callers own their rows)
        return stream[offset + start:offset + stop].copy()
    return stream[np.arange(offset + start, offset + stop) % len(stream)]


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
