"""Leaving samples out by key: ``Subset(exclude_keys=)`` over the column index agrees with the row path, and a
dataset's excluded rows (``exclude_rows``) drop out of every epoch, the rest keeping their order, including when the
list is added or extended at a resume: the rest of the interrupted epoch loses exactly those keys."""

from __future__ import annotations

import random

import numpy as np
import pytest

import shards
from preprocess.pack.packer import PackConfig, pack_manifest
from shards.errors import InputError
from shards.select.columns import open_columns
from shards.manifest import load_manifest
from shards.select.key_set import KeySet
from shards.select.mixture import Subset
from shards.order.plan import ShardSlice
from shards.select.selection import excluded_rows
from shards.loader.loader import workers_mode
from tests.helpers import make_shard_dataset, write_image_folder
from tests.shards.test_select_columns import _selection, write_dataset

SIZES = {"train": [7, 5, 9, 3, 6, 4, 8]}  # 42 samples, 7 shards
ALL_KEYS = [f"train_{i:05d}" for i in range(42)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("exclude")
    make_shard_dataset(out, shard_sizes=SIZES, size=(8, 8))
    return out


def build(folder, workers, *, excluded=(), buffer=6, batch=4, run="processes"):
    dataset = shards.open_dataset(folder, return_keys=True, seed=7,
                                  decode=shards.Decode(decoder=lambda sample, seed: 0),
                                  sampling=shards.Sampling(shuffle_buffer=buffer))
    if excluded:
        dataset.exclude_rows(excluded_rows(frozenset(excluded), None, dataset))
    return shards.make_loader(dataset, batch_size=batch, mode=workers_mode(workers, persistent=False, run=run),
                              drop_last=False)


def keys(batches):
    return [key for batch in batches for key in batch[2]]


def test_subset_exclude_keys_over_columns_equals_the_row_path(tmp_path):
    rng = random.Random("exclude")
    for dataset in range(4):
        folder = tmp_path / f"d{dataset}"
        manifest = write_dataset(folder, rng)
        names = [f"k{i:04d}" for i in range(manifest.split("train").samples)]
        for _ in range(6):
            subset = Subset(exclude_keys=rng.sample(names + ["absent"], rng.randint(1, len(names))),
                            classes=["cat", "dog"] if rng.random() < 0.3 else None)
            by_rows = _selection(folder, manifest, subset, columns=False)
            assert _selection(folder, manifest, subset, columns=True) == by_rows
            if subset.classes is None and not isinstance(by_rows[0], str):
                gone = len(set(names) & subset.exclude_keys)
                assert sum(len(runs) for runs in by_rows[1]) == len(names) - gone


def test_excluded_rows_from_columns_and_from_shards_agree(tmp_path):
    tree = write_image_folder(tmp_path / "src", ["cat", "dog"], per_class=5, size=(12, 12))
    pack_manifest(PackConfig(str(tree), str(tmp_path / "out"), max_samples=3, seed=1, quiet=True))
    dataset = shards.open_dataset(tmp_path / "out", "train", return_keys=True)
    every = [sample.key for shard, info in enumerate(dataset.split_info.shards)
             for sample in dataset.read_slice(ShardSlice(shard, 0, info.samples))]
    chosen = KeySet.of(every[::3] + ["not-a-key"])
    columns = open_columns(tmp_path / "out", load_manifest(tmp_path / "out"), "train")
    assert columns is not None
    assert excluded_rows(chosen, columns, dataset).tolist() == excluded_rows(chosen, None, dataset).tolist() \
        == [i for i, key in enumerate(every) if key in chosen]


def test_excluded_keys_leave_every_epoch_and_the_rest_keep_their_order(folder):
    gone = set(ALL_KEYS[3:12:2])
    for epoch in (0, 1):
        plain, less = build(folder, 0, buffer=0), build(folder, 0, excluded=gone, buffer=0)
        plain.set_epoch(epoch)
        less.set_epoch(epoch)
        assert keys(less) == [k for k in keys(plain) if k not in gone]
        assert len(less) == -(-(42 - len(gone)) // 4)


@pytest.mark.parametrize("new_workers", [2, 3])
@pytest.mark.slow
def test_an_exclusion_added_at_resume_removes_exactly_those_keys_from_the_rest(folder, new_workers):
    first = build(folder, 2)
    iterator = iter(first)
    head = keys(next(iterator) for _ in range(3))
    state = first.state_dict()
    del iterator
    gone = set(ALL_KEYS[::5])  # some already fed, most not
    resumed = build(folder, new_workers, excluded=gone)
    resumed.load_state_dict(state)
    rest = keys(resumed)
    assert len(rest) == len(set(rest))
    assert set(rest) == set(ALL_KEYS) - set(head) - gone  # nothing else lost, nothing fed twice
    computed = [s["key"] for step in range(3, len(resumed)) for s in resumed.batch_keys(0, step)]
    assert computed == rest  # lineage follows the exclusion
    resumed.set_epoch(1)
    assert set(keys(resumed)) == set(ALL_KEYS) - gone  # later epochs leave them out too


def test_an_exclusion_extended_at_a_second_resume(folder):
    # Threads: the exclusion replay is the cursor's, the same in every run mode, and no process starts.
    first = build(folder, 2, excluded=set(ALL_KEYS[:4]), run="threads")
    iterator = iter(first)
    head = keys(next(iterator) for _ in range(2))
    state = first.state_dict()
    del iterator
    assert state["excluded"] == [int(k.rsplit("_", 1)[1]) for k in ALL_KEYS[:4]]
    second = build(folder, 2, excluded=set(ALL_KEYS[:4] + ALL_KEYS[30:34]), run="threads")
    second.load_state_dict(state)
    iterator = iter(second)
    middle = keys(next(iterator) for _ in range(2))
    state2 = second.state_dict()
    del iterator
    third = build(folder, 1, excluded=set(ALL_KEYS[:4] + ALL_KEYS[30:34] + ALL_KEYS[40:]), run="threads")
    third.load_state_dict(state2)
    rest = keys(third)
    fed = head + middle + rest
    assert len(fed) == len(set(fed))
    assert set(fed) == set(ALL_KEYS) - set(ALL_KEYS[:4]) - set(ALL_KEYS[30:34]) - set(ALL_KEYS[40:]) \
        | (set(head + middle) & set(ALL_KEYS[30:34] + ALL_KEYS[40:]))


def test_a_malformed_excluded_record_is_refused(folder):
    first = build(folder, 2)
    state = first.state_dict()
    state["excluded"] = ["one"]
    with pytest.raises(InputError, match="excluded"):
        build(folder, 2, excluded={ALL_KEYS[0]}).load_state_dict(state)


def test_a_mixture_refuses_exclude_rows(folder):
    dataset = shards.open_dataset(shards.SourceSpec(folder, subset=Subset(exclude_keys=ALL_KEYS[:2])),
                                  return_keys=True, decode=shards.Decode(decoder=lambda sample, seed: 0))
    assert len(dataset) == 40
    with pytest.raises(InputError, match="Subset"):
        dataset.exclude_rows(np.asarray([1]))
