"""Checking a feature folder against its ``features.json`` and against the dataset it was computed from.

Three kinds of problem: a feature file missing or not matching its recorded size and sha256; a stale cache (the
source ``dataset.json`` changed since, an image shard was replaced or removed, or shards were added that have no
features yet); and, with ``full``, content that does not line up (row counts, feature width, dtype, and keys and
labels sample for sample against the image shards). Problems are returned as one-line strings, not raised, so
``shards verify`` can report all of them at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from shards.atomic import sha256_file
from shards.errors import ShardcacheError
from shards.formats.features import load_feature_shard
from shards.manifest import (DATASET_FILE, DatasetManifest, FeatureManifest, ShardInfo, dataset_manifest_sha256,
                             load_dataset_manifest, load_feature_manifest)
from shards.formats.storage import get_storage


def verify_feature_folder(folder: str | os.PathLike, *, full: bool = False) -> list[str]:
    """All problems found in ``folder`` (empty when the cache is complete, intact and current)."""
    folder = Path(folder)
    try:
        manifest = load_feature_manifest(folder)
    except ShardcacheError as exc:
        return [str(exc)]
    problems: list[str] = []
    for split in manifest.splits.values():
        for info in split.shards:
            problems.extend(_check_file(folder, info))
    dataset_dir = dataset_folder(folder, manifest)
    try:
        dataset = load_dataset_manifest(dataset_dir)
    except ShardcacheError as exc:
        return problems + [f"cannot check staleness: source dataset unreadable ({exc})"]
    problems.extend(_check_stale(folder, manifest, dataset, dataset_dir))
    if full:
        problems.extend(_check_alignment(folder, manifest, dataset, dataset_dir))
    return problems


def dataset_folder(folder: Path, manifest: FeatureManifest) -> Path:
    """Where the source dataset is: ``dataset_dir`` as recorded (relative paths count from the feature folder)."""
    recorded = Path(manifest.dataset_dir)
    return recorded if recorded.is_absolute() else folder / recorded


def _check_file(folder: Path, info: ShardInfo) -> list[str]:
    path = folder / info.path
    if not path.is_file():
        return [f"{path}: feature shard missing"]
    size = path.stat().st_size
    if size != info.bytes:
        return [f"{path}: {size} bytes, features.json records {info.bytes}"]
    if sha256_file(path) != info.sha256:
        return [f"{path}: sha256 does not match features.json (corrupt or replaced)"]
    return []


def _check_stale(folder: Path, manifest: FeatureManifest, dataset: DatasetManifest, dataset_dir: Path) -> list[str]:
    problems = []
    if dataset_manifest_sha256(dataset_dir) != manifest.dataset_sha256:
        problems.append(f"{folder}: stale: {dataset_dir / DATASET_FILE} changed since the features were computed")
    for name, split in manifest.splits.items():
        if name not in dataset.splits:
            problems.append(f"{folder}: stale: split {name!r} is no longer in the source dataset")
            continue
        sources = {shard.path: shard for shard in dataset.splits[name].shards}
        covered = set()
        for info in split.shards:
            source = sources.get(info.source or "")
            covered.add(info.source)
            if source is None:
                problems.append(f"{folder / info.path}: stale: source shard {info.source} is no longer in the dataset")
            elif info.source_sha256 is not None and source.sha256 != info.source_sha256:
                problems.append(f"{folder / info.path}: stale: source shard {info.source} changed (sha256 differs)")
        new = [path for path in sources if path not in covered]
        if new:
            problems.append(f"{folder}: stale: split {name!r} has {len(new)} image shard(s) without features "
                            f"(e.g. {new[0]}); rerun precompute-features to add them")
    return problems


def _check_alignment(folder: Path, manifest: FeatureManifest, dataset: DatasetManifest,
                     dataset_dir: Path) -> list[str]:
    problems = []
    dtype = getattr(torch, manifest.dtype, None)
    for split in manifest.splits.values():
        for info in split.shards:
            path = folder / info.path
            if not path.is_file():
                continue  # already reported
            try:
                shard = load_feature_shard(path)
            except ShardcacheError as exc:
                problems.append(str(exc))
                continue
            rows = shard.features.shape[0]
            if len(shard) != info.samples or rows != info.samples or shard.labels.shape[0] != info.samples:
                problems.append(f"{path}: {rows} rows and {len(shard)} keys, features.json records {info.samples}")
            if shard.features.ndim != 2 or shard.features.shape[1] != manifest.features_dim:
                problems.append(f"{path}: features shape {tuple(shard.features.shape)}, "
                                f"expected [N, {manifest.features_dim}]")
            if dtype is not None and shard.features.dtype != dtype:
                problems.append(f"{path}: dtype {shard.features.dtype}, features.json says {manifest.dtype}")
            if manifest.views and (shard.views is None or tuple(shard.views.shape) !=
                                   (rows, manifest.views, manifest.features_dim)):
                problems.append(f"{path}: views missing or not [N, {manifest.views}, {manifest.features_dim}]")
            problems.extend(_check_keys(path, shard, dataset, dataset_dir, info))
    return problems


def _check_keys(path: Path, shard, dataset: DatasetManifest, dataset_dir: Path, info: ShardInfo) -> list[str]:
    source = dataset_dir / (info.source or "")
    if info.source is None or not source.is_file():
        return [f"{path}: cannot check keys: source shard {source} missing"]
    try:
        pairs = [(sample.key, sample.label) for sample in get_storage(dataset.storage).read(source)]
    except (ShardcacheError, OSError) as exc:
        return [f"{path}: cannot check keys: {exc}"]
    keys = [key for key, _ in pairs]
    if keys != list(shard.keys):
        first = next((i for i, (a, b) in enumerate(zip(keys, shard.keys)) if a != b), min(len(keys), len(shard)))
        return [f"{path}: keys differ from {source} (first at row {first})"]
    if [label for _, label in pairs] != shard.labels.tolist():
        return [f"{path}: labels differ from {source}"]
    return []
