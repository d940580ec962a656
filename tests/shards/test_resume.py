"""Exact mid-epoch resume: a fresh reader loaded with the state yields exactly what the epoch had left, in order."""

import pytest
import torch

import shards
from tests.helpers import make_shard_dataset

SIZES = {"train": [7, 5, 9, 3, 6]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    make_shard_dataset(out, shard_sizes=SIZES, size=(16, 16))
    return out


def build(folder, workers, **options):
    dataset = shards.open_dataset(folder, transform="eval", return_keys=True, seed=3, shuffle_buffer=6, **options)
    return shards.make_loader(dataset, batch_size=4, num_workers=workers, drop_last=False, persistent_workers=False)


def key_batches(iterable):
    return [list(batch[2]) for batch in iterable]


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_resume_yields_exactly_the_rest(folder, workers):
    reference = build(folder, workers)
    reference.set_epoch(2)
    full = key_batches(reference)
    for taken in (1, 3, len(full) - 1):
        interrupted = build(folder, workers)
        interrupted.set_epoch(2)
        iterator = iter(interrupted)
        head = [list(next(iterator)[2]) for _ in range(taken)]
        state = interrupted.state_dict()
        del iterator
        resumed = build(folder, workers)
        resumed.load_state_dict(state)
        assert resumed.epoch == 2
        assert head + key_batches(resumed) == full


def test_resume_replays_class_weights_and_augmentations(folder):
    def loader():
        dataset = shards.open_dataset(folder, transform="train", return_keys=True, seed=5, class_weights="balanced",
                                      weight_window=8)
        return shards.make_loader(dataset, batch_size=3, num_workers=2, drop_last=True, persistent_workers=False)

    full = [(b[0], list(b[2])) for b in loader()]
    interrupted = loader()
    iterator = iter(interrupted)
    for _ in range(4):
        next(iterator)
    state = interrupted.state_dict()
    resumed = [(b[0], list(b[2])) for b in _loaded(loader(), state)]
    assert [k for _, k in resumed] == [k for _, k in full[4:]]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(resumed, full[4:]))


def _loaded(loader, state):
    loader.load_state_dict(state)
    return loader


def test_next_epoch_after_resume_is_a_full_epoch(folder):
    loader = build(folder, 2)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = build(folder, 2)
    resumed.load_state_dict(state)
    list(resumed)
    resumed.set_epoch(1)
    assert sum(len(b) for b in key_batches(resumed)) == 30


def test_dataset_state_without_loader(folder):
    dataset = shards.open_dataset(folder, return_keys=True, seed=2)
    full = [key for _, _, key in dataset]
    iterator = iter(dataset)
    head = [next(iterator)[2] for _ in range(11)]
    state = dataset.state_dict()
    fresh = shards.open_dataset(folder, return_keys=True, seed=2)
    fresh.load_state_dict(state)
    assert head + [key for _, _, key in fresh] == full


def test_resume_with_other_settings_is_refused(folder):
    loader = build(folder, 2)
    state = loader.state_dict()
    with pytest.raises(shards.errors.InputError, match="num_workers"):
        build(folder, 3).load_state_dict(state)
    with pytest.raises(shards.errors.InputError, match="seed"):
        other = shards.open_dataset(folder, seed=99)
        shards.make_loader(other, batch_size=4, num_workers=2, drop_last=False).load_state_dict(state)
