"""Elastic resume: a state saved with another worker count, world size or batch size continues its epoch with exactly
the samples the interrupted run had not yet yielded, once each, in equal shares; later epochs follow the new plan."""

import collections

import pytest

import shards
from shards.loader.in_process import InProcess
from shards.loader.worker_processes import WorkerProcesses
from shards.loader.loader import workers_mode
from tests.helpers import make_shard_dataset
from tests.shards.budget_helpers import smallest_budget
from tests.shards.label_columns import add_label_columns
from tests.shards.stream_helpers import write_feature_dataset

SIZES = {"train": [7, 5, 9, 3, 6, 4, 8]}  # 42 samples, 7 shards
ALL_KEYS = {f"train_{i:05d}" for i in range(42)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    make_shard_dataset(out, shard_sizes=SIZES, size=(8, 8))
    return out


@pytest.fixture(scope="module")
def weighted_folder(tmp_path_factory):
    """The same dataset with the column index ``pack-shards`` writes: the labels class weighting draws by."""
    out = tmp_path_factory.mktemp("elastic_weighted")
    make_shard_dataset(out, shard_sizes=SIZES, size=(8, 8))
    add_label_columns(out)
    return out


# The elastic replay is the loader cursor's, the same in every run mode: the quick tests run threads (no process
# starts); the slow ones below name processes, and the first parametrised test resumes across both.
def build(folder, workers, *, rank=0, world=1, batch=4, drop_last=False, run="threads", memory=None, **options):
    dataset = shards.open_dataset(folder, return_keys=True, seed=3,
                                  decode=shards.Decode(decoder=lambda sample, seed: 0),
                                  sampling=shards.Sampling(shuffle_buffer=6), **options,
                                  distributed=shards.Distributed(rank=rank, world_size=world))
    return shards.make_loader(dataset, batch_size=batch, mode=workers_mode(workers, persistent=False, run=run)
                              if workers else workers_mode(0), drop_last=drop_last, memory=memory)


def keys(loader_or_batches):
    return [key for batch in loader_or_batches for key in batch[2]]


def interrupted(loader, batches):
    """The keys of the first ``batches`` batches and the state saved after them."""
    iterator = iter(loader)
    head = keys(next(iterator) for _ in range(batches))
    state = loader.state_dict()
    del iterator
    return head, state


@pytest.mark.parametrize("runs", [("processes", "processes"), ("threads", "threads"), ("processes", "threads"),
                                  ("threads", "processes")], ids="-".join)
@pytest.mark.parametrize("new_workers", [1, 3])
@pytest.mark.parametrize("taken", [1, 4, 9])
@pytest.mark.slow
def test_two_workers_to_another_count_yields_exactly_the_missing_keys(folder, new_workers, taken, runs):
    head, state = interrupted(build(folder, 2, run=runs[0]), taken)
    resumed = build(folder, new_workers, run=runs[1])
    resumed.load_state_dict(state)
    batches = list(resumed)
    rest = keys(batches)
    assert len(rest) == len(set(rest)) and set(rest) == ALL_KEYS - set(head)
    assert len(resumed) == taken + len(batches)  # the epoch's batch count, those before the resume included
    assert sum(1 for batch in batches if len(batch[2]) < 4) <= 1  # whole batches: one partial at most


@pytest.mark.parametrize("runs", [("threads", "threads"), pytest.param(("processes", "threads"),
                                                                    marks=pytest.mark.slow)], ids="-".join)
def test_the_smallest_memory_budget_changes_no_key_of_an_elastic_resume(folder, runs):
    """Two workers saved, three resumed, each at the smallest budget it works in: the keys an unbudgeted loader
    yields, in its order."""
    def small(workers, run):
        return smallest_budget(lambda memory: build(folder, workers, run=run, memory=memory))

    head, state = interrupted(build(folder, 2, run=runs[0]), 4)
    reference = build(folder, 3, run=runs[1])
    reference.load_state_dict(state)
    small_head, small_state = interrupted(build(folder, 2, run=runs[0], memory=small(2, runs[0])), 4)
    resumed = build(folder, 3, run=runs[1], memory=small(3, runs[1]))
    resumed.load_state_dict(small_state)
    assert small_head == head and keys(resumed) == keys(reference)


def test_with_drop_last_only_the_last_partial_batch_is_left_out(folder):
    head, state = interrupted(build(folder, 2, drop_last=True), 3)
    for workers in (1, 3):
        resumed = build(folder, workers, drop_last=True)
        resumed.load_state_dict(state)
        rest = keys(resumed)
        assert len(rest) == len(set(rest)) and not set(rest) & set(head)
        assert len(ALL_KEYS - set(head) - set(rest)) < 4  # fewer than batch_size samples left out per rank
        assert len(rest) % 4 == 0


def test_world_size_two_to_three(folder):
    heads, states = [], []
    for rank in range(2):
        head, state = interrupted(build(folder, 2, rank=rank, world=2), 3)  # every rank: 3 batches
        heads += head
        states.append(state)
    audits = [state.pop("audit") for state in states]  # the keys each rank fed, beside the position
    assert states[0] == states[1] and [a["rank"] for a in audits] == [0, 1]  # the position does not depend on it
    missing = ALL_KEYS - set(heads)
    per_rank = []
    for rank in range(3):
        resumed = build(folder, 0 if rank else 2, rank=rank, world=3)  # the worker count may change too
        resumed.load_state_dict(states[0])
        per_rank.append(keys(resumed))
    assert len({len(rest) for rest in per_rank}) == 1  # equal counts: no DDP hang
    everything = [key for rest in per_rank for key in rest]
    assert set(everything) == missing
    padded = len(everything) - len(missing)  # repeats of the remainder's first samples, as for a whole epoch
    assert 0 <= padded < 3 and collections.Counter(everything).most_common(1)[0][1] <= 2


def test_world_size_three_to_two_with_dataset_drop_last(folder):
    heads, state = [], None
    for rank in range(3):
        head, state = interrupted(build(folder, 1, rank=rank, world=3, drop_last=False), 2)
        heads += head
    missing = ALL_KEYS - set(heads)
    everything = []
    for rank in range(2):
        dataset = shards.open_dataset(folder, return_keys=True, seed=3,
                                      decode=shards.Decode(decoder=lambda sample, seed: 0),
                                      # equal shares by leaving samples out, not by repeating some
                                      sampling=shards.Sampling(shuffle_buffer=6, balance="drop"),
                                      distributed=shards.Distributed(rank=rank, world_size=2))
        resumed = shards.make_loader(dataset, batch_size=4, mode=InProcess(), drop_last=False)
        with pytest.raises(shards.errors.InputError, match="sampling"):
            resumed.load_state_dict(state)  # the dataset's drop_last changes the epoch: refused
        resumed = build(folder, 0, rank=rank, world=2)
        resumed.load_state_dict(state)
        everything += keys(resumed)
    assert set(everything) == missing and len(everything) == len(missing) + len(missing) % 2


@pytest.mark.slow
def test_a_continued_epoch_resumes_again_in_any_layout(folder):
    head, state = interrupted(build(folder, 2, run="processes"), 3)
    second = build(folder, 3, run="processes")
    second.load_state_dict(state)
    full_rest = [list(batch[2]) for batch in second]

    again = build(folder, 3, run="processes")
    again.load_state_dict(state)
    middle, state2 = interrupted(again, 2)
    assert state2["prior"]["num_workers"] == 2 and state2["batches"] == 5
    same = build(folder, 3, run="processes")  # the same layout as the continued epoch: bitwise exact, same order
    same.load_state_dict(state2)
    assert full_rest[:2] == [middle[:4], middle[4:]]
    assert [list(batch[2]) for batch in same] == full_rest[2:]

    other = build(folder, 1, run="processes")  # and another layout again: the two-link chain is replayed
    other.load_state_dict(state2)
    rest = keys(other)
    assert len(rest) == len(set(rest)) and set(rest) == ALL_KEYS - set(head) - set(middle)


@pytest.mark.slow
def test_later_epochs_follow_the_new_layouts_plan(folder):
    _, state = interrupted(build(folder, 2, run="processes"), 2)
    resumed = build(folder, 3, run="processes")
    resumed.load_state_dict(state)
    list(resumed)
    resumed.set_epoch(1)
    fresh = build(folder, 3, run="processes")
    fresh.set_epoch(1)
    assert keys(resumed) == keys(fresh) and len(resumed) == len(fresh)


def test_another_batch_size_also_continues_the_epoch(folder):
    head, state = interrupted(build(folder, 2, batch=4), 3)
    resumed = build(folder, 2, batch=5)
    resumed.load_state_dict(state)
    rest = keys(resumed)
    assert len(rest) == len(set(rest)) and set(rest) == ALL_KEYS - set(head)


def weighted(folder, workers, *, rank=0, world=1, batch=4):
    """A loader of class-weighted draws: class b (weight 0) never comes, class c (weight 4) about four times over."""
    dataset = shards.open_dataset(folder, return_keys=True, seed=3, decode=shards.Decode(decoder=lambda s, seed: 0),
                                  sampling=shards.Sampling(shuffle_buffer=6, class_weights=(1.0, 0.0, 4.0)),
                                  distributed=shards.Distributed(rank=rank, world_size=world))
    return shards.make_loader(dataset, batch_size=batch, mode=workers_mode(workers, persistent=False),
                              drop_last=False)


@pytest.mark.parametrize("new_workers,new_world,new_batch", [(1, 1, 4), (3, 1, 5), (0, 3, 3)])
@pytest.mark.slow
def test_a_class_weighted_epoch_resumed_in_another_layout_yields_exactly_the_remaining_draws(
        weighted_folder, new_workers, new_world, new_batch):
    """Two workers stopped after 3 batches; the new layout's ranks yield the epoch's draws the old run had not
    (a key drawn three times and yielded once comes twice more), padded to equal rank shares by repeating the
    first draws left, as any remainder is."""
    full = collections.Counter(keys(weighted(weighted_folder, 2)))
    head, state = interrupted(weighted(weighted_folder, 2), 3)
    rest = collections.Counter()
    for rank in range(new_world):
        resumed = weighted(weighted_folder, new_workers, rank=rank, world=new_world, batch=new_batch)
        resumed.load_state_dict(state)
        rest.update(keys(resumed))
    left = full - collections.Counter(head)
    assert sum(left.values()) == sum(full.values()) - len(head)  # the head was drawn from the epoch's draws
    padding = rest - left
    assert not left - rest and sum(padding.values()) < new_world and set(padding) <= set(left)
    assert max(full.values()) > 1 and not [k for k in full if int(k.rsplit("_", 1)[1]) % 3 == 1]  # weighted


def test_a_state_without_progress_starts_the_new_layouts_epoch(folder):
    state = build(folder, 2).state_dict()
    resumed = build(folder, 3)
    resumed.load_state_dict(state)
    assert keys(resumed) == keys(build(folder, 3))


def test_feature_batches_across_world_sizes(tmp_path):
    write_feature_dataset(tmp_path, [5, 7, 4, 9])  # 25 rows; the first feature is the row number

    def loader(rank, world):
        return shards.make_loader(shards.open_dataset(tmp_path, seed=5,
                                                      distributed=shards.Distributed(rank=rank, world_size=world)),
                                  batch_size=3, drop_last=False)

    head = []
    state = None
    for rank in range(2):
        old = loader(rank, 2)
        iterator = iter(old)
        head += [int(r) for _ in range(2) for r in next(iterator)[0][:, 0].tolist()]
        state = old.state_dict()
    per_rank = []
    for rank in range(3):
        resumed = loader(rank, 3)
        resumed.load_state_dict(state)
        rows = [int(r) for batch in resumed for r in batch[0][:, 0].tolist()]
        assert len(resumed) == 2 + -(-len(rows) // 3)
        per_rank.append(rows)
    assert len({len(rows) for rows in per_rank}) == 1
    everything = [r for rows in per_rank for r in rows]
    assert set(everything) == set(range(25)) - set(head) and len(everything) - len(set(everything)) < 3


def test_persistent_workers_started_before_the_load_read_the_remainder(folder):
    head, state = interrupted(build(folder, 2), 3)
    dataset = shards.open_dataset(folder, return_keys=True, seed=3, decode=shards.Decode(decoder=lambda s, seed: 0),
                                  sampling=shards.Sampling(shuffle_buffer=6))
    loader = shards.make_loader(dataset, batch_size=4, mode=WorkerProcesses(1), drop_last=False)
    assert set(keys(loader)) == ALL_KEYS  # the workers are running now
    loader.load_state_dict(state)
    rest = keys(loader)
    assert len(rest) == len(set(rest)) and set(rest) == ALL_KEYS - set(head)
