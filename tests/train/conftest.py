"""Generated inputs for the training tests: separable feature caches and tiny image shard folders."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import pytest
import torch

from shards.formats.features import FeatureShard, feature_shard_name, write_feature_shard
from shards.transport.manifest_io import dataset_sha256_at
from shards.manifest import DatasetManifest, FeatureManifest, ShardInfo, SplitInfo
from shards.provenance import SourceInfo
from shards.transport.storage import shard_name
from tests.helpers import colour_shards


def write_feature_folder(root: Path, *, shard_sizes: dict[str, Sequence[int]], classes: Sequence[str],
                         dim: int = 16, seed: int = 0, separation: float = 4.0,
                         label_shift: dict[str, int] | None = None,
                         dtype: torch.dtype = torch.float16, transform: Callable | None = None) -> Path:
    """``root/dataset`` (a dataset.json only) and ``root/features``: class means far apart plus unit noise.

    ``label_shift`` ({split: k}) stores that split's labels rotated by k against the means: the features say one
    class and the label another, which is what a broken label mapping looks like. ``transform`` maps each shard's
    rows before they are stored (e.g. per-dimension scales and offsets).
    """
    dataset_dir, features_dir = root / "dataset", root / "features"
    dataset_dir.mkdir(parents=True, exist_ok=True)
    features_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(len(classes), dim, generator=generator)
    means = separation * means / means.norm(dim=1, keepdim=True)
    image_splits, feature_splits = {}, {}
    for split, sizes in shard_sizes.items():
        image_shards, feature_shards, counts, n = [], [], [0] * len(classes), 0
        for index, size in enumerate(sizes):
            name = shard_name(split, index, "tar")
            labels = torch.tensor([(n + i) % len(classes) for i in range(size)], dtype=torch.int64)
            rows = means[labels] + torch.randn(size, dim, generator=generator)
            rows = transform(rows) if transform is not None else rows
            stored = (labels + (label_shift or {}).get(split, 0)) % len(classes)
            keys = [f"{split}_{n + i:05d}" for i in range(size)]
            for label in stored.tolist():
                counts[label] += 1
            n += size
            target = features_dir / feature_shard_name(name, "pt")
            nbytes, digest = write_feature_shard(target, FeatureShard(rows.to(dtype), stored, keys), "pt")
            image_shards.append(ShardInfo(name, size, 0, "0" * 64))
            feature_shards.append(ShardInfo(target.name, size, nbytes, digest, source=name))
        image_splits[split] = SplitInfo(n, tuple(counts), tuple(image_shards))
        feature_splits[split] = SplitInfo(n, tuple(counts), tuple(feature_shards))
    DatasetManifest(storage="tar", classes=tuple(classes), splits=image_splits,
                    source=SourceInfo(kind="generated", root="", files_seen=0), packing={"seed": 0}).save(dataset_dir)
    FeatureManifest(storage="pt", classes=tuple(classes), splits=feature_splits, features_dim=dim,
                    dtype=str(dtype).removeprefix("torch."), views=0,
                    config={"backbone": "generated", "dim": dim}, config_hash="test",
                    dataset_dir=str(dataset_dir),
                    dataset_sha256=dataset_sha256_at(dataset_dir)).save(features_dir)
    return features_dir


@pytest.fixture
def feature_folder(tmp_path: Path) -> Path:
    """4 classes, 16-dim, uneven train shards (a total that divides by neither 2 ranks nor the batch size)."""
    return write_feature_folder(tmp_path / "cache", shard_sizes={"train": [70, 45, 29, 17], "val": [37, 24]},
                                classes=("ant", "bee", "cat", "dog"))


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """3 colour-coded classes of 32x32 JPEGs in uneven tar shards."""
    return colour_shards(tmp_path / "images")

