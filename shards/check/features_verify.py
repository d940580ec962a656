"""Checking a feature folder against its ``features.json`` and against the dataset it was computed from.

Four kinds of problem: a feature file missing or not matching its recorded size and sha256; content that breaks
``features.json``'s promises (row counts, feature width, dtype, labels outside the class count, keys that are not
unique strings; every file is loaded with ``weights_only=True``); a stale cache (the source ``dataset.json`` changed
since, an image shard was replaced or removed, or shards were added that have no features yet); and, with ``full``,
keys and labels that differ sample for sample from the image shards. Problems are returned as one-line strings,
not raised, so ``shards verify`` can report all of them at once.
"""

from __future__ import annotations

import os
from pathlib import Path

from shards.atomic import sha256_file
from shards.check.freshness import feature_staleness
from shards.errors import ShardcacheError
from shards.formats.features import FeatureShard, FeatureSpec, feature_shard_problems, load_feature_shard
from shards.formats.feature_names import from_table
from shards.formats.locations import dataset_folder as _recorded_dataset_folder, local_shard_path
from shards.manifest import (DATASET_FILE, DatasetManifest, FeatureManifest, ShardInfo,
                             load_dataset_manifest, load_feature_manifest)
from shards.formats.storage import get_storage


def verify_feature_folder(folder: str | os.PathLike, *, full: bool = False) -> list[str]:
    """All problems found in ``folder`` (empty when the cache is complete, intact and current).

    Every feature file is loaded (``weights_only=True``) and its content checked against ``features.json``: row
    count, feature width and dtype, int64 labels within the class count, unique string keys, views. With ``full``,
    keys and labels are also compared sample for sample with the image shards when the dataset is reachable.
    """
    folder = Path(folder)
    try:
        manifest = load_feature_manifest(folder)
    except ShardcacheError as exc:
        return [str(exc)]
    problems: list[str] = []
    readable = []
    for split in manifest.splits.values():
        for info in split.shards:
            file_problems = _check_file(folder, info)
            problems.extend(file_problems)
            if file_problems:
                continue  # missing, outside the folder or not the bytes recorded: nothing more to learn
            content, shard = _check_content(folder, info, manifest)
            problems.extend(content)
            if shard is not None:
                readable.append(info)
    if from_table(manifest.config):
        return problems
    if manifest.dataset_dir.startswith("s3://"):  # not followed from a local features.json (DESIGN: untrusted input)
        from shards.check.freshness import staleness_or_warn

        return problems + staleness_or_warn(folder, manifest)
    dataset_dir = dataset_folder(folder, manifest)
    try:
        dataset = load_dataset_manifest(dataset_dir)
    except ShardcacheError as exc:
        return problems + [f"cannot check staleness: source dataset unreadable ({exc})"]
    problems.extend(_check_stale(folder, manifest, dataset, dataset_dir))
    if full:
        problems.extend(_check_alignment(folder, readable, dataset, dataset_dir))
    return problems


def dataset_folder(folder: Path, manifest: FeatureManifest) -> Path:
    """Where the source dataset is: ``dataset_dir`` as recorded (relative paths count from the feature folder).

    Only that folder's ``dataset.json`` is read from it, and image shards only as that manifest lists them."""
    return _recorded_dataset_folder(folder, manifest.dataset_dir)


def _check_file(folder: Path, info: ShardInfo) -> list[str]:
    try:
        path = local_shard_path(folder, info.path)
    except ShardcacheError as exc:  # a symlink out of the folder: reported, never read
        return [str(exc)]
    if not path.is_file():
        return [f"{path}: feature shard missing"]
    size = path.stat().st_size
    if size != info.bytes:
        return [f"{path}: {size} bytes, features.json records {info.bytes}"]
    if sha256_file(path) != info.sha256:
        return [f"{path}: sha256 does not match features.json (corrupt or replaced)"]
    return []


def _check_stale(folder: Path, manifest: FeatureManifest, dataset: DatasetManifest, dataset_dir: Path) -> list[str]:
    return feature_staleness(folder, manifest, dataset_dir, dataset)


def _check_content(folder: Path, info: ShardInfo, manifest: FeatureManifest) -> tuple[list[str], FeatureShard | None]:
    """Problems with what the file holds, and the loaded shard when it loads at all."""
    try:
        path = local_shard_path(folder, info.path)
    except ShardcacheError:
        return [], None  # already reported by _check_file, never read
    if not path.is_file():
        return [], None  # already reported
    try:
        shard = load_feature_shard(path)
    except ShardcacheError as exc:
        return [str(exc)], None
    spec = FeatureSpec.of(manifest)
    problems = [f"{path}: {problem}" for problem in feature_shard_problems(shard, info.samples, spec)]
    seen: set[str] = set()
    for row, key in enumerate(shard.keys):
        if key in seen:
            problems.append(f"{path}: duplicate key {key!r} at row {row}")
            break
        seen.add(key)
    return problems, shard


def _check_alignment(folder: Path, infos: list[ShardInfo], dataset: DatasetManifest,
                     dataset_dir: Path) -> list[str]:
    """Keys and labels sample for sample against the image shards the features were computed from."""
    problems = []
    for info in infos:
        path = local_shard_path(folder, info.path)
        shard = load_feature_shard(path)
        problems.extend(_check_keys(path, shard, dataset, dataset_dir, info))
    return problems


def _check_keys(path: Path, shard, dataset: DatasetManifest, dataset_dir: Path, info: ShardInfo) -> list[str]:
    # Only an image shard the dataset's own manifest lists is opened, confined to the dataset folder.
    listed = {s.path for split in dataset.splits.values() for s in split.shards}
    if info.source not in listed:
        return [f"{path}: cannot check keys: source shard {info.source} is not in {dataset_dir / DATASET_FILE}"]
    try:
        source = local_shard_path(dataset_dir, info.source)
    except ShardcacheError as exc:
        return [f"{path}: cannot check keys: {exc}"]
    if not source.is_file():
        return [f"{path}: cannot check keys: source shard {source} missing"]
    try:
        pairs = [(sample.key, sample.label) for sample in get_storage(dataset.storage).read(source)]
    except (ShardcacheError, OSError) as exc:
        return [f"{path}: cannot check keys: {exc}"]
    keys = [key for key, _ in pairs]
    if keys != list(shard.keys):
        first = next((i for i, (a, b) in enumerate(zip(keys, shard.keys)) if a != b), min(len(keys), len(shard)))
        image_key = keys[first] if first < len(keys) else "(none)"
        feature_key = shard.keys[first] if first < len(shard) else "(none)"
        return [f"{path} [sample {feature_key}]: keys differ from {source} (first at row {first}: the image shard "
                f"has {image_key})"]
    labels = shard.labels.tolist()
    if [label for _, label in pairs] != labels:
        wrong = next((i for i, ((_, a), b) in enumerate(zip(pairs, labels)) if a != b), min(len(pairs), len(labels)))
        key = keys[wrong] if wrong < len(keys) else "(none)"
        return [f"{path} [sample {key}]: labels differ from {source} (first at row {wrong})"]
    return []
