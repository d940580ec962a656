"""The one staleness rule: a feature cache is stale when its dataset.json, a split or an image shard changed."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from shards.check.freshness import check_features_fresh, feature_staleness, shard_staleness
from shards.errors import StaleCacheError
from shards.transport.manifest_io import dataset_sha256_at
from shards.manifest import (FeatureManifest, ShardInfo, SplitInfo, load_dataset_manifest)
from tests.helpers import make_shard_dataset


def _features_of(data_dir: Path) -> FeatureManifest:
    """A features.json (no feature files: staleness never reads them) computed from the dataset as it is now."""
    dataset = load_dataset_manifest(data_dir)
    splits = {name: SplitInfo(split.samples, split.class_counts, tuple(
        ShardInfo(Path(s.path).stem + ".pt", s.samples, 1, "0" * 64, s.path, s.sha256) for s in split.shards))
        for name, split in dataset.splits.items()}
    return FeatureManifest("pt", dataset.classes, splits, 4, "float16", 0, {}, "abc", str(data_dir),
                           dataset_sha256_at(data_dir))


@pytest.fixture
def cache(tmp_path):
    data_dir = tmp_path / "data"
    make_shard_dataset(data_dir, shard_sizes={"train": [3, 2], "val": [2]})
    return tmp_path / "feat", data_dir, _features_of(data_dir)


def _change_dataset(data_dir: Path, **changes) -> None:
    dataset = load_dataset_manifest(data_dir)
    dataclasses.replace(dataset, **changes).save(data_dir)


def test_a_current_cache_is_fresh(cache):
    folder, data_dir, manifest = cache
    assert feature_staleness(folder, manifest, data_dir) == []
    check_features_fresh(folder, manifest)


def test_a_changed_dataset_json_is_stale_and_refused_in_one_line(cache):
    folder, data_dir, manifest = cache
    _change_dataset(data_dir, packing={"seed": 1})
    cheap = feature_staleness(folder, manifest, data_dir, deep=False)
    assert len(cheap) == 1 and "stale" in cheap[0] and "dataset.json changed" in cheap[0]
    with pytest.raises(StaleCacheError) as info:
        check_features_fresh(folder, manifest)
    message = str(info.value)
    assert "\n" not in message and "stale features" in message and "features.json" in message


def test_a_replaced_added_or_removed_image_shard_is_named(cache):
    folder, data_dir, manifest = cache
    dataset = load_dataset_manifest(data_dir)
    train = dataset.splits["train"]
    replaced = dataclasses.replace(train.shards[0], sha256="f" * 64)
    added = dataclasses.replace(train.shards[1], path="train-000009.tar")
    splits = {"train": dataclasses.replace(train, shards=(replaced, added))}  # val removed, shard 1 renamed
    _change_dataset(data_dir, splits=splits)
    problems = feature_staleness(folder, manifest, data_dir)
    assert any("dataset.json changed" in p for p in problems)
    assert any(f"{train.shards[0].path} changed (sha256 differs)" in p for p in problems)
    assert any(f"{train.shards[1].path} is no longer in the dataset" in p for p in problems)
    assert any("1 image shard(s) without features (e.g. train-000009.tar)" in p for p in problems)
    assert any("split 'val' is no longer in the source dataset" in p for p in problems)
    assert all(": stale: " in p for p in problems)


def test_shard_staleness_compares_the_recorded_source_sha256():
    info = ShardInfo("train-000000.pt", 3, 1, "0" * 64, "train-000000.tar", "a" * 64)
    assert shard_staleness(info, "a" * 64) is None
    assert "changed" in shard_staleness(info, "b" * 64)
    assert "no longer in the dataset" in shard_staleness(info, None)
    unrecorded = dataclasses.replace(info, source_sha256=None)  # older caches: judged by dataset.json alone
    assert shard_staleness(unrecorded, "b" * 64) is None


def test_a_dataset_that_is_gone_is_a_warning_not_an_error(cache, caplog):
    folder, data_dir, manifest = cache
    (data_dir / "dataset.json").unlink()
    with caplog.at_level(logging.WARNING):
        check_features_fresh(folder, manifest)
    assert "cannot check freshness" in caplog.text
