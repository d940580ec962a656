"""Small builders for the streaming-reader tests: custom image shards (imbalanced, with bad samples) and features."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from shards.formats.features import FeatureShard, feature_shard_name, write_feature_shard
from shards.manifest import DatasetManifest, FeatureManifest, ShardInfo, SplitInfo
from shards.provenance import SourceInfo
from shards.formats.sample import RawSample
from shards.transport.storage import get_storage, shard_name
from tests.helpers import class_image


def write_labelled_shards(out: Path, labels_per_shard: Sequence[Sequence[int]], *, classes=("a", "b", "c"),
                          storage: str = "tar", bad_keys: Sequence[str] = (), split: str = "train",
                          size=(16, 16)) -> DatasetManifest:
    """Shards with the given labels; samples whose key is in ``bad_keys`` hold bytes that are not an image."""
    out.mkdir(parents=True, exist_ok=True)
    writer_type = get_storage(storage).writer
    shards, counts, n = [], [0] * len(classes), 0
    for index, labels in enumerate(labels_per_shard):
        name = shard_name(split, index, storage)
        with writer_type(out / name, classes=classes) as writer:
            for label in labels:
                key = f"s{n:05d}"
                data = b"\xff\xd8 not a jpeg at all" if key in bad_keys else class_image(label, n, size)
                meta = json.dumps({"class": classes[label]}).encode()
                writer.write(RawSample(key, data, "jpg", label, meta))
                counts[label] += 1
                n += 1
        shards.append(ShardInfo(name, writer.samples, writer.bytes, writer.sha256))
    manifest = DatasetManifest(storage=storage, classes=tuple(classes),
                               splits={split: SplitInfo(n, tuple(counts), tuple(shards))},
                               source=SourceInfo(kind="generated", root="", files_seen=n), packing={"seed": 0})
    manifest.save(out)
    return manifest


def write_feature_dataset(out: Path, shard_sizes: Sequence[int], *, dim: int = 4, classes=("a", "b", "c"),
                          storage: str = "pt", split: str = "train", first_row: int = 0) -> FeatureManifest:
    """Feature shards whose first feature column is the global row number (plus ``first_row``, to tell the
    sources of a mixture apart), so order is easy to check."""
    out.mkdir(parents=True, exist_ok=True)
    shards, counts, n = [], [0] * len(classes), 0
    for index, size in enumerate(shard_sizes):
        rows = torch.arange(first_row + n, first_row + n + size, dtype=torch.float32)
        features = torch.stack([rows] + [rows * 0 + j for j in range(1, dim)], dim=1).to(torch.float16)
        labels = torch.arange(n, n + size) % len(classes)
        keys = [f"f{i:05d}" for i in range(n, n + size)]
        for label in labels.tolist():
            counts[label] += 1
        name = feature_shard_name(shard_name(split, index, "tar"), storage)
        nbytes, digest = write_feature_shard(out / name, FeatureShard(features, labels, keys), storage)
        shards.append(ShardInfo(name, size, nbytes, digest, source=shard_name(split, index, "tar")))
        n += size
    manifest = FeatureManifest(storage=storage, classes=tuple(classes),
                               splits={split: SplitInfo(n, tuple(counts), tuple(shards))}, features_dim=dim,
                               dtype="float16", views=0, config={"backbone": "test"}, config_hash="0" * 16,
                               dataset_dir="", dataset_sha256="0" * 64)
    manifest.save(out)
    return manifest
