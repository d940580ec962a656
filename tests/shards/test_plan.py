"""Properties of the epoch plan: what every rank and worker reads, as a pure function of its inputs."""

import collections
import random

import numpy as np
import pytest

from shards.errors import InputError
from shards.order.plan import (
    ShardSlice, epoch_sizes, epoch_stream, indices_to_slices, plan_epoch, round_robin_consumed, shard_offsets, share_of,
    slices_to_indices, worker_sample_counts,
)
from shards.order.reads import CoveringReads
from shards.position.resume import worker_batches


def samples_of(slices):
    return [(s.shard, i) for s in slices for i in range(s.start, s.stop)]


def all_reads(sizes, seed, epoch, world, workers, drop_last=False):
    """rank -> list of samples, concatenating the rank's workers in worker order."""
    return {rank: [x for w in range(workers) for x in samples_of(plan_epoch(
        sizes, seed=seed, epoch=epoch, rank=rank, world_size=world, worker=w, num_workers=workers,
        drop_last=drop_last))] for rank in range(world)}


CASES = [([7, 5, 9, 3], 2, 3), ([1, 1, 1], 4, 2), ([10], 3, 4), ([0, 4, 0, 6], 2, 1), ([3, 8, 2, 2, 9], 3, 3),
         ([2], 5, 1)] + [([random.Random(i).randint(0, 12) for _ in range(random.Random(i).randint(1, 7))],
                          random.Random(i + 1).randint(1, 4), random.Random(i + 2).randint(1, 4)) for i in range(40)]


@pytest.mark.parametrize("sizes,world,workers", CASES)
def test_every_sample_once_and_ranks_equal(sizes, world, workers):
    reads = all_reads(sizes, 3, 1, world, workers)
    counts = {len(r) for r in reads.values()}
    assert len(counts) == 1  # equal per-rank counts
    everything = [x for r in reads.values() for x in r]
    universe = [(s, i) for s, n in enumerate(sizes) for i in range(n)]
    sizes_info = epoch_sizes(sum(sizes), world)
    assert len(everything) == sum(sizes) + sizes_info.padded
    tally = collections.Counter(everything)
    assert set(tally) == set(universe)
    assert sum(c - 1 for c in tally.values()) == sizes_info.padded


@pytest.mark.parametrize("sizes,world,workers", CASES)
def test_drop_last_drops_the_same_manifest_tail_every_epoch(sizes, world, workers):
    universe = [(s, i) for s, n in enumerate(sizes) for i in range(n)]
    dropped = epoch_sizes(sum(sizes), world, drop_last=True).dropped
    expected_missing = set(universe[len(universe) - dropped:]) if dropped else set()
    for epoch in (0, 1, 2):
        reads = all_reads(sizes, 0, epoch, world, workers, drop_last=True)
        everything = [x for r in reads.values() for x in r]
        assert len(everything) == len(set(everything))  # no repeats
        assert set(universe) - set(everything) == expected_missing
        assert len({len(r) for r in reads.values()}) == 1


def test_padding_repeats_the_first_samples_of_the_epoch():
    sizes = [4, 3]
    reads = all_reads(sizes, 5, 0, 3, 1)  # 7 samples over 3 ranks -> 9, two repeated
    order = [x for r in range(3) for x in reads[r]]
    assert order[7:] == order[:2]


def test_workers_split_the_rank_share_without_loss():
    sizes = [7, 5, 9, 3]
    for world in (1, 2, 3):
        for rank in range(world):
            whole = samples_of(plan_epoch(sizes, seed=1, epoch=2, rank=rank, world_size=world))
            for workers in (1, 2, 3, 5):
                split = [x for w in range(workers) for x in samples_of(plan_epoch(
                    sizes, seed=1, epoch=2, rank=rank, world_size=world, worker=w, num_workers=workers))]
                assert split == whole


def test_same_inputs_same_plan_and_new_epoch_new_order():
    sizes = [5] * 12
    first = plan_epoch(sizes, seed=7, epoch=0)
    assert first == plan_epoch(sizes, seed=7, epoch=0)
    assert first != plan_epoch(sizes, seed=7, epoch=1)
    assert first != plan_epoch(sizes, seed=8, epoch=0)


def test_no_shuffle_is_manifest_order():
    sizes = [3, 0, 4]
    assert samples_of(plan_epoch(sizes, seed=9, epoch=4, shuffle=False)) == [
        (0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2), (2, 3)]


def test_bad_arguments_are_input_errors():
    with pytest.raises(InputError, match="rank"):
        plan_epoch([3], seed=0, epoch=0, rank=2, world_size=2)
    with pytest.raises(InputError, match="worker"):
        plan_epoch([3], seed=0, epoch=0, worker=3, num_workers=2)
    with pytest.raises(InputError, match="non-negative"):
        plan_epoch([-1], seed=0, epoch=0)


def naive_round_robin(batches, consumed):
    remaining, taken, order = list(batches), [0] * len(batches), []
    w = 0
    while len(order) < consumed:
        if remaining[w]:
            remaining[w] -= 1
            taken[w] += 1
            order.append(w)
        w = (w + 1) % len(batches)
    if not any(remaining):
        return taken, 0
    nxt = w
    while not remaining[nxt]:
        nxt = (nxt + 1) % len(batches)
    return taken, nxt


@pytest.mark.parametrize("batches", [[3, 1, 2], [5], [2, 2, 2], [4, 4, 3, 0], [1, 6], [0, 3]])
def test_round_robin_replay_matches_a_step_by_step_simulation(batches):
    for consumed in range(sum(batches) + 1):
        assert round_robin_consumed(batches, consumed) == naive_round_robin(batches, consumed)


def test_worker_counts_add_up():
    assert worker_sample_counts(10, 3) == [4, 3, 3]
    assert sum(worker_sample_counts(0, 4)) == 0


# -- whole batches per worker ------------------------------------------------------------------------------------
BATCH_CASES = [(random.Random(i).randint(0, 3000), random.Random(i + 1).randint(1, 300),
                random.Random(i + 2).randint(1, 9)) for i in range(200)] + [(6000, 64, 2), (10000, 256, 8), (7, 4, 3)]


@pytest.mark.parametrize("per_rank,batch,workers", BATCH_CASES)
def test_every_worker_but_one_holds_whole_batches(per_rank, batch, workers):
    counts = worker_sample_counts(per_rank, workers, batch)
    assert sum(counts) == per_rank
    assert sum(1 for n in counts if n % batch) <= 1
    assert max(counts) - min(counts) <= batch  # within one batch of each other
    kept = sum(worker_batches(per_rank, workers, batch, True, batch)) * batch
    assert per_rank - kept < batch  # drop_last loses less than one batch per rank
    partial = sum(worker_batches(per_rank, workers, batch, False, batch)) - sum(
        worker_batches(per_rank, workers, batch, True, batch))
    assert partial == (1 if per_rank % batch else 0)


def test_whole_batches_drop_less_than_a_batch_where_the_sample_split_dropped_a_batch_per_worker():
    def dropped(per_rank, batch, workers, split):
        return per_rank - sum(worker_batches(per_rank, workers, batch, True, split)) * batch

    assert dropped(6000, 64, 2, split=1) == 112 and dropped(6000, 64, 2, split=64) == 48
    assert dropped(10000, 256, 8, split=1) == 1808 and dropped(10000, 256, 8, split=256) == 16


@pytest.mark.parametrize("sizes,world,workers", CASES[:20])
def test_whole_batch_split_keeps_every_sample_once(sizes, world, workers):
    for drop_last in (False, True):
        for rank in range(world):
            whole = samples_of(plan_epoch(sizes, seed=2, epoch=1, rank=rank, world_size=world, drop_last=drop_last))
            split = [x for w in range(workers) for x in samples_of(plan_epoch(
                sizes, seed=2, epoch=1, rank=rank, world_size=world, worker=w, num_workers=workers,
                drop_last=drop_last, batch_size=3))]
            assert split == whole


@pytest.mark.parametrize("sizes,world,workers", CASES[:20])
def test_share_of_the_epoch_stream_is_the_plan(sizes, world, workers):
    offsets = shard_offsets(sizes)
    for drop_last in (False, True):
        stream = epoch_stream(sizes, seed=4, epoch=2, world_size=world, drop_last=drop_last)
        for rank in range(world):
            for worker in range(workers):
                plan = plan_epoch(sizes, seed=4, epoch=2, rank=rank, world_size=world, worker=worker,
                                  num_workers=workers, drop_last=drop_last, batch_size=2)
                share = share_of(stream, rank=rank, world_size=world, worker=worker, num_workers=workers,
                                 drop_last=drop_last, batch_size=2)
                assert share.tolist() == slices_to_indices(plan, offsets).tolist()
                assert indices_to_slices(share, offsets) == [p for p in plan if p.size]


def _reads(plan, max_gap, offsets=np.array([0, 10, 20, 30])):
    rows = slices_to_indices(plan, offsets)
    return [(piece, None if keep is None else keep.tolist()) for piece, keep in CoveringReads(rows, offsets, max_gap)]


def test_covering_reads_merge_scattered_rows_of_one_shard_in_order():
    plan = [ShardSlice(0, 2, 4), ShardSlice(0, 6, 7), ShardSlice(1, 0, 3), ShardSlice(0, 9, 10), ShardSlice(0, 3, 5)]
    assert _reads(plan, lambda shard: None) == [
        (ShardSlice(0, 2, 7), [0, 1, 4]),  # rows 2, 3, 6 of shard 0
        (ShardSlice(1, 0, 3), None),
        (ShardSlice(0, 9, 10), None),
        (ShardSlice(0, 3, 5), None),  # starts before the last read ended: a read of its own, order kept
    ]
    bounded = _reads(plan, lambda shard: 1)  # a gap of 2 rows is more than 1 may pass over
    assert [piece for piece, _ in bounded][:2] == [ShardSlice(0, 2, 4), ShardSlice(0, 6, 7)]
    assert _reads([], lambda shard: None) == []


def test_a_row_drawn_twice_is_read_once_and_kept_twice():
    offsets = np.array([0, 10, 20])
    reads = [(piece, None if keep is None else keep.tolist())
             for piece, keep in CoveringReads(np.array([3, 3, 4, 6, 6, 6, 12, 12, 13]), offsets, lambda shard: 1)]
    assert reads == [(ShardSlice(0, 3, 7), [0, 0, 1, 3, 3, 3]), (ShardSlice(1, 2, 4), [0, 0, 1])]


def _reference_reads(rows, offsets, max_gap):
    """The definition, slice by slice: runs of neighbours, then each run merged into the read before it when it is
    of the same shard, starts after that read ended (or on its last row again: a row drawn twice by class weighting)
    and passes over at most ``max_gap(shard)`` rows."""
    reads = []
    for piece in indices_to_slices(rows, offsets):
        if reads:
            last, kept = reads[-1]
            gap, limit = piece.start - last.stop, max_gap(piece.shard)
            if piece.shard == last.shard and gap >= -1 and (limit is None or gap <= limit):
                kept = (kept if kept is not None else list(range(last.start, last.stop))) \
                    + list(range(piece.start, piece.stop))
                reads[-1] = (ShardSlice(last.shard, last.start, piece.stop), kept)
                continue
        reads.append((piece, None))
    return [(piece, None if kept is None else [k - piece.start for k in kept]) for piece, kept in reads]


@pytest.mark.parametrize("seed", range(60))
def test_covering_reads_equal_the_slice_by_slice_definition(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 30, rng.integers(1, 6))
    offsets = shard_offsets(sizes.tolist())
    total = int(offsets[-1])
    kind = seed % 4
    if kind == 0:  # a shuffled subset
        rows = rng.permutation(total)[: rng.integers(0, total + 1)]
    elif kind == 1:  # sorted scattered rows, as a subset in shard order
        rows = np.sort(rng.choice(total, rng.integers(0, total + 1), replace=False))
    elif kind == 2:  # runs of neighbours in shuffled order
        rows = np.concatenate([np.arange(a, min(a + 5, total)) for a in rng.integers(0, total, 6)])
    else:  # class-weighted draws: shuffled shards front to back, each row 0 to 3 times in a row
        stream = np.concatenate([np.arange(offsets[s], offsets[s + 1]) for s in rng.permutation(len(sizes))])
        rows = np.repeat(stream, rng.integers(0, 4, len(stream)))
    limits = {s: (None if rng.random() < 0.3 else int(rng.integers(0, 4))) for s in range(len(sizes))}
    got = [(piece, None if keep is None else keep.tolist())
           for piece, keep in CoveringReads(rows, offsets, limits.get)]
    assert got == _reference_reads(rows, offsets, limits.get)