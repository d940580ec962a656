"""Node affinity of the epoch plan: each node's ranks keep reading the same shards epoch after epoch (so a node-local
shard cache that holds only part of the dataset keeps hitting), every sample is still read once per epoch, one node
is exactly the plain shuffle, and a state saved on one node count resumes on another."""

import collections
import random

import numpy as np
import pytest

import shards
from shards.errors import InputError
from shards.stream.dataset import StreamConfig
from shards.order.plan import (
    epoch_sizes, epoch_stream, node_shards, plan_epoch, shard_offsets, shard_order, share_of,
)
from shards.position.resume import LoaderState
from shards.loader.loader import workers_mode
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset

_SIZES = random.Random(7)
SHARD_SIZES = [_SIZES.randint(20, 80) for _ in range(40)]  # 40 shards of 20..80 samples, 1819 in all: 1 of padding
NODES, RANKS_PER_NODE = 2, 2
WORLD = NODES * RANKS_PER_NODE


def samples_of(slices):
    return [(s.shard, i) for s in slices for i in range(s.start, s.stop)]


def rank_reads(sizes, epoch, *, world=WORLD, seed=3, **affinity):
    """rank -> the samples it reads this epoch, its workers (three, in whole batches of 4) concatenated."""
    return {rank: [x for worker in range(3) for x in samples_of(plan_epoch(
        sizes, seed=seed, epoch=epoch, rank=rank, world_size=world, worker=worker, num_workers=3, batch_size=4,
        **affinity))] for rank in range(world)}


def node_shard_sets(sizes, epoch, **affinity):
    """node -> the shards with any sample in that node's ranks' plans (ranks numbered node by node)."""
    reads = rank_reads(sizes, epoch, **affinity)
    return [{shard for rank in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
             for shard, _ in reads[rank]} for node in range(NODES)]


def overlap(first: set, second: set) -> float:
    """Jaccard overlap: the share of shards a node cache needs in either epoch that it needs in both."""
    return len(first & second) / len(first | second)


def epoch_overlaps(seed, **affinity):
    per_epoch = [node_shard_sets(SHARD_SIZES, epoch, seed=seed, **affinity) for epoch in range(4)]
    return [overlap(per_epoch[a][node], per_epoch[b][node])
            for a in range(4) for b in range(a + 1, 4) for node in range(NODES)]


# -- one node is the plan of before --------------------------------------------------------------------------------
def test_one_node_is_exactly_the_plan_without_affinity():
    sizes = [3, 5, 2, 4, 1, 6]
    for rank in range(2):
        default = plan_epoch(sizes, seed=11, epoch=2, rank=rank, world_size=2)
        assert plan_epoch(sizes, seed=11, epoch=2, rank=rank, world_size=2, nodes=1, rotate_every=3) == default
    # Computed with shard_order before node affinity existed: saved states and their runs depend on it.
    assert shard_order(6, seed=11, epoch=2) == [2, 1, 5, 4, 3, 0]
    assert shard_order(6, seed=11, epoch=2, nodes=1, rotate_every=2, shard_sizes=sizes) == [2, 1, 5, 4, 3, 0]
    assert [tuple(s) for s in plan_epoch(sizes, seed=11, epoch=2, rank=1, world_size=2, nodes=1)] == [
        (5, 4, 6), (4, 0, 1), (3, 0, 4), (0, 0, 3), (2, 0, 1)]


def test_no_shuffle_ignores_affinity():
    assert shard_order(5, seed=1, epoch=3, shuffle=False, nodes=2, shard_sizes=[1] * 5) == [0, 1, 2, 3, 4]


# -- locality ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_each_node_reads_the_same_shards_every_epoch(seed):
    # About 20 shards a node: one foreign shard in an epoch (the padding, which repeats the stream's first samples,
    # or a shard straddling the node boundary) costs 5%, so this allows about one in each of two epochs.
    assert min(epoch_overlaps(seed, nodes=NODES)) >= 0.9
    node_block = epoch_sizes(sum(SHARD_SIZES), WORLD).per_rank * RANKS_PER_NODE
    for epoch in range(4):
        reads = rank_reads(SHARD_SIZES, epoch, seed=seed, nodes=NODES)
        partition = node_shards(SHARD_SIZES, seed=seed, epoch=epoch, nodes=NODES, node_block=node_block)
        for node, own in enumerate(partition):
            read = [shard for rank in range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)
                    for shard, _ in reads[rank]]
            assert np.mean(np.isin(read, own)) >= 0.99  # nearly every sample comes from the node's own shards


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("epoch", range(4))
def test_every_sample_is_still_read_once_per_epoch_in_equal_shares(seed, epoch):
    reads = rank_reads(SHARD_SIZES, epoch, seed=seed, nodes=NODES)
    assert len({len(r) for r in reads.values()}) == 1
    tally = collections.Counter(x for r in reads.values() for x in r)
    assert set(tally) == {(s, i) for s, n in enumerate(SHARD_SIZES) for i in range(n)}
    assert sum(tally.values()) - len(tally) == epoch_sizes(sum(SHARD_SIZES), WORLD).padded


def test_with_drop_last_the_same_manifest_tail_is_left_out_and_nothing_repeats():
    dropped = epoch_sizes(sum(SHARD_SIZES), WORLD, drop_last=True).dropped
    universe = [(s, i) for s, n in enumerate(SHARD_SIZES) for i in range(n)]
    for epoch in range(3):
        reads = rank_reads(SHARD_SIZES, epoch, nodes=NODES, drop_last=True)
        everything = [x for r in reads.values() for x in r]
        assert len(everything) == len(set(everything)) and len({len(r) for r in reads.values()}) == 1
        assert set(universe) - set(everything) == set(universe[len(universe) - dropped:])


def test_the_partition_rotates_every_rotate_every_epochs():
    def partition(epoch):
        return node_shards(SHARD_SIZES, seed=3, epoch=epoch, nodes=NODES, rotate_every=2)

    assert partition(0) == partition(1) != partition(2) == partition(3)
    assert [node_shard_sets(SHARD_SIZES, e, nodes=NODES, rotate_every=2) for e in (0, 1)] != [
        node_shard_sets(SHARD_SIZES, e, nodes=NODES, rotate_every=2) for e in (2, 3)]
    assert node_shards(SHARD_SIZES, seed=3, epoch=7, nodes=NODES) == partition(0)  # 0: never rotate
    # Inside a group the partition stays, but each epoch still has its own order.
    assert plan_epoch(SHARD_SIZES, seed=3, epoch=0, nodes=2, world_size=4, rotate_every=2) != plan_epoch(
        SHARD_SIZES, seed=3, epoch=1, nodes=2, world_size=4, rotate_every=2)


@pytest.mark.parametrize("seed", range(6))
def test_without_affinity_a_node_reads_other_shards_every_epoch(seed):
    # The cost affinity removes: with a global shuffle, a node needs mostly other shards in the next epoch.
    assert np.mean(epoch_overlaps(seed)) < 0.5 and max(epoch_overlaps(seed)) < 0.7
    assert np.mean(epoch_overlaps(seed, nodes=NODES)) >= 0.9


def same_shard_neighbours(sizes, epoch, nodes):
    """Per rank, the fraction of neighbouring samples in its stream (before the shuffle buffer) from one shard."""
    offsets = shard_offsets(sizes)
    stream = epoch_stream(sizes, seed=3, epoch=epoch, world_size=WORLD, nodes=nodes)
    fractions = []
    for rank in range(WORLD):
        shard_of = np.searchsorted(offsets, share_of(stream, rank=rank, world_size=WORLD), side="right") - 1
        fractions.append(np.mean(shard_of[1:] == shard_of[:-1]))
    return np.array(fractions)


@pytest.mark.parametrize("epoch", range(3))
def test_shuffle_quality_a_ranks_stream_is_no_more_clustered_and_nodes_see_half_the_shards(epoch):
    # A rank reads whole shards front to back either way, so its stream is as clustered with affinity as without
    # (what the shuffle buffer has to mix is the same) ...
    with_affinity = same_shard_neighbours(SHARD_SIZES, epoch, NODES)
    without = same_shard_neighbours(SHARD_SIZES, epoch, 1)
    assert abs(with_affinity.mean() - without.mean()) < 0.01 and with_affinity.max() < 0.99
    # ... and in one epoch a node reads about 1/nodes of the shards, as without affinity; the difference is over
    # epochs: without rotation a node never leaves its half, with a global shuffle it soon reads nearly all.
    per_node = node_shard_sets(SHARD_SIZES, epoch, nodes=NODES)
    assert all(abs(len(shards_read) - 40 / NODES) <= 2 for shards_read in per_node)
    settings = {"fixed": {"nodes": NODES}, "rotating": {"nodes": NODES, "rotate_every": 1}, "global": {}}
    seen = {name: set().union(*(node_shard_sets(SHARD_SIZES, e, **kw)[0] for e in range(4)))
            for name, kw in settings.items()}  # node 0's shards over four epochs
    assert len(seen["fixed"]) <= 40 / NODES + 2
    assert len(seen["rotating"]) >= 30 and len(seen["global"]) >= 30


def test_bad_affinity_settings_are_refused_naming_the_field():
    with pytest.raises(InputError, match="nodes"):
        StreamConfig(world_size=4, nodes=3)
    with pytest.raises(InputError, match="nodes"):
        StreamConfig(world_size=4, nodes=0)
    with pytest.raises(InputError, match="rotate_every"):
        StreamConfig(world_size=4, nodes=2, rotate_every=-1)
    with pytest.raises(InputError, match="nodes"):
        plan_epoch([3, 4], seed=0, epoch=0, world_size=3, nodes=2)


# -- elastic resume ------------------------------------------------------------------------------------------------
DATA_SIZES = [7, 5, 9, 3, 6, 4, 8, 11, 2, 6, 5, 9]  # 75 samples, 12 shards
ALL_KEYS = {f"train_{i:05d}" for i in range(sum(DATA_SIZES))}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("affinity")
    make_shard_dataset(out, shard_sizes={"train": DATA_SIZES}, size=(8, 8))
    return out


def build(folder, workers, *, rank=0, world=1, nodes=None, rotate_every=0):
    dataset = shards.open_dataset(folder, return_keys=True, seed=3,
                                  decode=shards.Decode(decoder=lambda sample, seed: 0),
                                  sampling=shards.Sampling(shuffle_buffer=6),
                                  distributed=shards.Distributed(rank=rank, world_size=world, nodes=nodes,
                                                                 rotate_every=rotate_every))
    return shards.make_loader(dataset, batch_size=4, mode=workers_mode(workers, persistent=False), drop_last=False)


def keys(batches):
    return [key for batch in batches for key in batch[2]]


def interrupted_run(folder, batches, *, world, nodes, workers=2, **options):
    """Every rank of a run stops after ``batches`` batches: the keys they yielded, and rank 0's state."""
    head, state = [], None
    for rank in range(world):
        loader = build(folder, workers, rank=rank, world=world, nodes=nodes, **options)
        iterator = iter(loader)
        head += keys(next(iterator) for _ in range(batches))
        state = loader.state_dict()
        del iterator
    return head, state


def resumed_run(folder, state, *, world, nodes, workers=1, **options):
    per_rank = []
    for rank in range(world):
        loader = build(folder, workers, rank=rank, world=world, nodes=nodes, **options)
        loader.load_state_dict(state)
        per_rank.append(keys(loader))
    return per_rank


@pytest.mark.parametrize("world,nodes,workers", [
    pytest.param(2, None, 1, marks=pytest.mark.slow),  # over half a second in the quick loop
    pytest.param(3, 1, 1, marks=pytest.mark.slow),
    pytest.param(6, 2, 1, marks=pytest.mark.slow),
    pytest.param(4, None, 2, marks=pytest.mark.slow),
    pytest.param(4, 4, 2, marks=pytest.mark.slow),
])
def test_a_state_saved_on_two_nodes_resumes_on_another_layout_with_exactly_the_rest(folder, world, nodes, workers):
    head, state = interrupted_run(folder, 2, world=4, nodes=2)
    assert state["nodes"] == 2
    per_rank = resumed_run(folder, state, world=world, nodes=nodes, workers=workers)  # (4, .., 2): nodes alone
    assert len({len(rest) for rest in per_rank}) == 1  # equal counts: no DDP hang
    rest = [key for keys_of_rank in per_rank for key in keys_of_rank]
    missing = ALL_KEYS - set(head)
    assert len(head) == len(set(head)) and set(rest) == missing
    assert len(rest) - len(missing) == epoch_sizes(len(missing), world).padded  # only the remainder's padding


@pytest.mark.slow
def test_a_state_saved_on_two_nodes_resumes_exactly_on_two_nodes(folder):
    whole = [keys(build(folder, 2, rank=rank, world=4, nodes=2)) for rank in range(4)]
    head, state = interrupted_run(folder, 3, world=4, nodes=2)
    rest = resumed_run(folder, state, world=4, nodes=2, workers=2)
    assert [whole[rank][12:] for rank in range(4)] == rest  # the same layout continues bitwise
    assert sorted(head) == sorted(key for rank in range(4) for key in whole[rank][:12])


@pytest.mark.slow
def test_a_state_saved_on_one_node_resumes_on_two_nodes(folder):
    head, state = interrupted_run(folder, 2, world=2, nodes=None)
    assert LoaderState.from_dict(state).node_count == 1
    per_rank = resumed_run(folder, state, world=2, nodes=2, workers=2)  # only the node count differs
    rest = [key for keys_of_rank in per_rank for key in keys_of_rank]
    assert set(rest) == ALL_KEYS - set(head) and len(rest) - len(set(rest)) <= 1
    exact = resumed_run(folder, state, world=2, nodes=None, workers=2)  # and bitwise exactly on one node
    whole = [keys(build(folder, 2, rank=rank, world=2)) for rank in range(2)]
    assert exact == [whole[rank][8:] for rank in range(2)]


def test_another_rotation_is_refused(folder):
    _, state = interrupted_run(folder, 1, world=2, nodes=2, rotate_every=2)
    loader = build(folder, 2, world=2, nodes=2, rotate_every=3)
    with pytest.raises(InputError, match="sampling"):
        loader.load_state_dict(state)
    unrotated = build(folder, 2, world=2, nodes=2)
    with pytest.raises(InputError, match="sampling"):
        unrotated.load_state_dict(state)


def test_feature_batches_follow_the_node_affinity_plan_and_resume_across_nodes(tmp_path):
    write_feature_dataset(tmp_path, [5, 7, 4, 9, 6, 3])  # 34 rows; the first feature is the row number

    def loader(rank, world, nodes):
        dataset = shards.open_dataset(tmp_path, seed=5,
                                      distributed=shards.Distributed(rank=rank, world_size=world, nodes=nodes))
        return shards.make_loader(dataset, batch_size=3, drop_last=False)

    def rows(batches):
        return [int(r) for batch in batches for r in batch[0][:, 0].tolist()]

    whole = [rows(loader(rank, 2, 2)) for rank in range(2)]
    assert sorted(whole[0] + whole[1]) == list(range(34)) and len(whole[0]) == len(whole[1])
    head, state = [], None
    for rank in range(2):
        old = loader(rank, 2, 2)
        iterator = iter(old)
        head += rows(next(iterator) for _ in range(2))
        state = old.state_dict()
    rest = []
    for rank in range(3):  # one node of three ranks
        resumed = loader(rank, 3, None)
        resumed.load_state_dict(state)
        rest += rows(resumed)
    assert set(rest) == set(range(34)) - set(head) and len(rest) - len(set(rest)) < 3
