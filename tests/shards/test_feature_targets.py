"""Regression targets in feature shards: an optional float32 ``targets`` entry that round-trips in both formats,
is checked when features.json promises it, and is what the streams yield for a regression table."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import shards
from shards.errors import CorruptDataError, InputError
from shards.formats.features import (H5_VERSION, FeatureShard, FeatureSpec, feature_shard_name,
                                     feature_shard_problems, load_feature_bytes, load_feature_shard, target_task,
                                     write_feature_shard)
from shards.formats.h5columns import write_text_column
from shards.manifest import FeatureManifest, ShardInfo, SplitInfo
from shards.loader.in_process import InProcess

SIZES = [6, 4, 5]
REGRESSION = {"kind": "table", "target": {"column": "y", "task": "regression", "mean": 3.0, "std": 2.0,
                                          "stored_as": "targets"}}


def target_of(row: torch.Tensor) -> torch.Tensor:
    """Each row's target is a function of its first feature (its global row number), so order is checkable."""
    return row * 0.5 + 0.25


def shard_of(start: int, size: int, *, targets: bool = True) -> FeatureShard:
    rows = torch.arange(start, start + size, dtype=torch.float32)
    features = torch.stack([rows, -rows], dim=1)
    return FeatureShard(features, torch.zeros(size, dtype=torch.int64), [f"row-{i:06d}" for i in range(start,
                                                                                                      start + size)],
                        targets=target_of(rows) if targets else None)


def write_regression_folder(out: Path, storage: str, *, targets: bool = True) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    infos, start = [], 0
    for index, size in enumerate(SIZES):
        name = feature_shard_name(f"train-{index:06d}", storage)
        nbytes, digest = write_feature_shard(out / name, shard_of(start, size, targets=targets), storage)
        infos.append(ShardInfo(name, size, nbytes, digest))
        start += size
    FeatureManifest(storage=storage, classes=(), splits={"train": SplitInfo(start, (), tuple(infos))},
                    features_dim=2, dtype="float32", views=0, config=REGRESSION, config_hash="0" * 16,
                    dataset_dir=".", dataset_sha256="0" * 64).save(out)
    return out


@pytest.mark.parametrize("storage", ["pt", "hdf5"])
def test_targets_round_trip_from_files_and_bytes(tmp_path: Path, storage: str):
    path = tmp_path / feature_shard_name("train-000000", storage)
    write_feature_shard(path, shard_of(0, 5), storage)
    for loaded in (load_feature_shard(path), load_feature_bytes(path.read_bytes(), str(path))):
        assert loaded.targets.dtype == torch.float32
        torch.testing.assert_close(loaded.targets, target_of(loaded.features[:, 0]))


def test_files_written_without_targets_still_load(tmp_path: Path):
    payload = {"features": torch.zeros(3, 2), "labels": torch.tensor([0, 1, 0]), "keys": ["a", "b", "c"]}
    with open(tmp_path / "old.pt", "wb") as handle:
        torch.save(payload, handle)
    with h5py.File(tmp_path / "old.h5", "w") as f:  # the current layout, without the optional entries
        f.attrs["version"] = H5_VERSION
        f.create_dataset("features", data=np.zeros((3, 2), np.float32))
        f.create_dataset("labels", data=np.array([0, 1, 0]))
        write_text_column(f, "key", ["a", "b", "c"])
    for path in (tmp_path / "old.pt", tmp_path / "old.h5"):
        for loaded in (load_feature_shard(path), load_feature_bytes(path.read_bytes(), str(path))):
            assert loaded.targets is None and loaded.views is None and loaded.keys == ["a", "b", "c"]


def test_problems_check_targets_only_when_promised():
    spec = FeatureSpec(features_dim=2, dtype="float32", num_classes=None, targets=True)
    assert feature_shard_problems(shard_of(0, 4), 4, spec) == []  # all-zero placeholder labels, no class range
    assert feature_shard_problems(shard_of(0, 4, targets=False), 4, FeatureSpec(2, "float32")) == []
    missing = feature_shard_problems(shard_of(0, 4, targets=False), 4, spec)
    assert missing == ["targets are missing, expected float32 [4] (features.json records a regression target)"]
    wrong = shard_of(0, 4)
    assert "targets are torch.float64 (4,)" in feature_shard_problems(
        FeatureShard(wrong.features, wrong.labels, wrong.keys, targets=wrong.targets.double()), 4, spec)[0]
    broken = wrong.targets.clone()
    broken[2] = float("nan")
    problems = feature_shard_problems(FeatureShard(wrong.features, wrong.labels, wrong.keys, targets=broken), 4, spec)
    assert problems == ["target nan at row 2 (key row-000002) is not a finite number (1 such rows)"]


def test_target_task_reads_the_manifest_config():
    assert target_task(REGRESSION) == "regression"
    assert target_task({"target": {"task": "classification", "column": "y"}}) == "classification"
    assert target_task({"backbone": "resnet18"}) == "classification"


@pytest.mark.parametrize("storage", ["pt", "hdf5"])
def test_samples_pair_features_with_float_targets(tmp_path: Path, storage: str):
    folder = write_regression_folder(tmp_path / "feat", storage)
    dataset = shards.open_dataset(folder, sampling=shards.Sampling(shuffle=False))
    assert dataset.task == "regression"
    items = list(dataset)
    assert len(items) == sum(SIZES)
    for features, target in items:
        assert isinstance(target, float) and target == pytest.approx(float(target_of(features[0])))


@pytest.mark.parametrize("cache", ["memory", "none"])
@pytest.mark.parametrize("storage", ["pt", "hdf5"])
def test_batches_are_features_and_float32_targets(tmp_path: Path, storage: str, cache: str):
    folder = write_regression_folder(tmp_path / "feat", storage)
    loader = shards.make_loader(shards.open_dataset(folder, seed=3, cache=cache), batch_size=4, drop_last=False)
    assert loader.mode == InProcess()
    rows = []
    for features, targets in loader:
        assert targets.dtype == torch.float32 and targets.shape == (len(features),)
        torch.testing.assert_close(targets, target_of(features[:, 0]))
        rows += features[:, 0].int().tolist()
    assert sorted(rows) == list(range(sum(SIZES)))


def test_a_promised_target_missing_from_a_shard_is_corrupt_data(tmp_path: Path):
    folder = write_regression_folder(tmp_path / "feat", "pt", targets=False)
    with pytest.raises(CorruptDataError, match="targets are missing"):
        list(shards.open_dataset(folder, sampling=shards.Sampling(shuffle=False)))


def test_class_weights_are_refused_for_a_regression_table(tmp_path: Path):
    folder = write_regression_folder(tmp_path / "feat", "pt")
    for weights in ("balanced", (1.0,)):  # there are no classes to weight
        with pytest.raises(InputError, match="class_weights"):
            shards.open_dataset(folder, sampling=shards.Sampling(class_weights=weights))
