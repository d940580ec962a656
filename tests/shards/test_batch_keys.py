"""``loader.batch_keys(epoch, step)``: computed from the order, it names exactly the keys each batch held, in every
layout, an epoch resumed in the same layout or continued in another included, class-weighted draws included."""

import pytest

import shards
from shards.loader.loader import workers_mode
from tests.helpers import make_shard_dataset
from tests.shards.label_columns import add_label_columns
from tests.shards.stream_helpers import write_feature_dataset

SIZES = {"train": [7, 5, 9, 3, 6, 4, 8]}  # 42 samples, 7 shards


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("batch_keys")
    make_shard_dataset(out, shard_sizes=SIZES, size=(8, 8))
    add_label_columns(out)  # the labels class weighting draws by
    return out


def build(folder, workers, *, rank=0, world=1, batch=4, drop_last=False, weights=None, run="processes"):
    dataset = shards.open_dataset(folder, return_keys=True, seed=5,
                                  decode=shards.Decode(decoder=lambda sample, seed: 0),
                                  sampling=shards.Sampling(shuffle_buffer=6, class_weights=weights),
                                  distributed=shards.Distributed(rank=rank, world_size=world))
    return shards.make_loader(dataset, batch_size=batch, mode=workers_mode(workers, persistent=False, run=run)
                              if workers else workers_mode(0), drop_last=drop_last)


def computed(loader, epoch, steps):
    return [[s["key"] for s in loader.batch_keys(epoch, step)] for step in range(steps)]


@pytest.mark.parametrize("run", ["processes", "threads"])
@pytest.mark.parametrize("workers,world,drop_last", [(0, 1, False), (2, 1, False), (3, 2, True)])
@pytest.mark.slow
def test_batch_keys_equal_the_batches_iterated_in_two_epochs(folder, workers, world, drop_last, run):
    for rank in range(world):
        loader = build(folder, workers, rank=rank, world=world, drop_last=drop_last, run=run)
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            fed = [list(batch[2]) for batch in loader]
            assert computed(loader, epoch, len(fed)) == fed
        with pytest.raises(ValueError, match="outside"):
            loader.batch_keys(1, len(loader))


def test_samples_name_their_shard_and_row(folder):
    loader = build(folder, 2)
    sample = loader.batch_keys(0, 0)[0]
    index = int(sample["key"].rsplit("_", 1)[1])  # make_shard_dataset numbers keys by global row
    assert sample["row"] == index and sample["shard"].endswith(".tar")


def fed_then_saved(loader, batches):
    """The keys of the loader's next ``batches`` batches, and its state after them."""
    iterator = iter(loader)
    keys = [list(next(iterator)[2]) for _ in range(batches)]
    state = loader.state_dict()
    del iterator
    return keys, state


@pytest.mark.slow  # over half a second in the quick loop
def test_an_epoch_continued_in_another_layout_and_again_in_a_third(folder):
    head, state = fed_then_saved(build(folder, 2), 3)
    second = build(folder, 3)
    second.load_state_dict(state)
    middle, state2 = fed_then_saved(second, 2)

    third = build(folder, 1)
    third.load_state_dict(state2)
    assert computed(third, 0, 5) == head + middle  # the earlier layouts' batches, replayed
    rest = [list(batch[2]) for batch in third]
    assert [[s["key"] for s in third.batch_keys(0, 5 + i)] for i in range(len(rest))] == rest


@pytest.mark.slow  # over half a second in the quick loop
def test_a_same_layout_resume_answers_as_the_uninterrupted_run(folder):
    whole = [list(batch[2]) for batch in build(folder, 2)]
    first = build(folder, 2)
    iterator = iter(first)
    for _ in range(4):
        next(iterator)
    state = first.state_dict()
    del iterator
    resumed = build(folder, 2)
    resumed.load_state_dict(state)
    assert computed(resumed, 0, len(whole)) == whole


def test_feature_batches(tmp_path):
    write_feature_dataset(tmp_path, [5, 7, 4])
    dataset = shards.open_dataset(tmp_path, return_keys=True, seed=1)
    loader = shards.make_loader(dataset, batch_size=3, drop_last=False)
    loader.set_epoch(1)
    fed = [list(batch[2]) for batch in loader]
    assert computed(loader, 1, len(fed)) == fed


WEIGHTS = (1.0, 0.0, 4.0)  # class b never drawn, class c about four times over


@pytest.mark.parametrize("run", ["processes", "threads"])
@pytest.mark.parametrize("workers,world", [(0, 1), (2, 1), (3, 2)])
@pytest.mark.slow
def test_weighted_batch_keys_equal_the_batches_iterated(folder, workers, world, run):
    for rank in range(world):
        loader = build(folder, workers, rank=rank, world=world, weights=WEIGHTS, run=run)
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            fed = [list(batch[2]) for batch in loader]
            assert computed(loader, epoch, len(fed)) == fed
            drawn = [key for batch in fed for key in batch]
            assert len(drawn) > len(set(drawn))  # a key drawn more than once is in its batches each time


@pytest.mark.slow  # over half a second in the quick loop
def test_a_weighted_epoch_continued_in_another_layout(folder):
    head, state = fed_then_saved(build(folder, 2, weights=WEIGHTS), 3)
    second = build(folder, 3, batch=5, weights=WEIGHTS)
    second.load_state_dict(state)
    assert computed(second, 0, 3) == head  # the first layout's batches, replayed
    rest = [list(batch[2]) for batch in second]
    assert [[s["key"] for s in second.batch_keys(0, 3 + i)] for i in range(len(rest))] == rest


def test_weighted_feature_batches(tmp_path):
    write_feature_dataset(tmp_path, [5, 7, 4])
    dataset = shards.open_dataset(tmp_path, return_keys=True, seed=1,
                                  sampling=shards.Sampling(class_weights=WEIGHTS))
    loader = shards.make_loader(dataset, batch_size=3, drop_last=False)
    loader.set_epoch(1)
    fed = [list(batch[2]) for batch in loader]
    assert computed(loader, 1, len(fed)) == fed
