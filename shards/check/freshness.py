"""Is a feature cache still the features of its dataset? The one staleness rule, for every stage that asks.

Features are stale when what they were computed from has changed: the source ``dataset.json`` (its sha256 is
recorded in ``features.json``), a split or image shard that is gone, an image shard whose sha256 differs from the
one recorded per feature shard, or image shards added since that have no features yet. ``shards verify`` lists
every such problem (``feature_staleness``), ``train-from-shards`` refuses to start on the first
(``check_features_fresh``), and ``precompute-features`` recomputes a shard whose source changed
(``shard_staleness``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

from shards.errors import StaleCacheError
from shards.formats.locations import dataset_folder
from shards.manifest import (DATASET_FILE, FEATURES_FILE, DatasetManifest, FeatureManifest, ShardInfo,
                             dataset_manifest_sha256, load_dataset_manifest)

log = logging.getLogger("shardcache.check")


def shard_staleness(info: ShardInfo, source_sha256: str | None) -> str | None:
    """Why feature shard ``info`` no longer matches its image shard, whose current sha256 is ``source_sha256``
    (None: the image shard is no longer in the dataset); None when it still matches. A feature shard that
    recorded no source sha256 (older caches) is judged by the dataset.json check alone."""
    if source_sha256 is None:
        return f"source shard {info.source} is no longer in the dataset"
    if info.source_sha256 is not None and info.source_sha256 != source_sha256:
        return f"source shard {info.source} changed (sha256 differs)"
    return None


def feature_staleness(folder: str | Path, manifest: FeatureManifest, dataset_dir: str | Path,
                      dataset: DatasetManifest | None = None, *, deep: bool = True) -> list[str]:
    """Every reason the features in ``folder`` are stale against the dataset in ``dataset_dir`` ([] if fresh).

    The dataset.json sha256 comparison always runs; ``deep`` also names the splits and shards that changed, reading
    ``dataset`` (or ``dataset_dir``'s dataset.json). Each reason is one line starting with the path concerned.
    """
    folder, dataset_dir = Path(folder), Path(dataset_dir)
    problems = []
    current = dataset_manifest_sha256(dataset_dir)
    if current != manifest.dataset_sha256:
        problems.append(f"{folder}: stale: {dataset_dir / DATASET_FILE} changed since the features were computed "
                        f"(sha256 {manifest.dataset_sha256[:12]}... then, {current[:12]}... now)")
    if not deep:
        return problems
    dataset = load_dataset_manifest(dataset_dir) if dataset is None else dataset
    for name, split in manifest.splits.items():
        if name not in dataset.splits:
            problems.append(f"{folder}: stale: split {name!r} is no longer in the source dataset")
            continue
        sources: Mapping[str, ShardInfo] = {shard.path: shard for shard in dataset.splits[name].shards}
        covered = set()
        for info in split.shards:
            covered.add(info.source)
            source = sources.get(info.source or "")
            reason = shard_staleness(info, None if source is None else source.sha256)
            if reason is not None:
                problems.append(f"{folder / info.path}: stale: {reason}")
        new = [path for path in sources if path not in covered]
        if new:
            problems.append(f"{folder}: stale: split {name!r} has {len(new)} image shard(s) without features "
                            f"(e.g. {new[0]}); rerun precompute-features to add them")
    return problems


def check_features_fresh(folder: str | Path, manifest: FeatureManifest) -> None:
    """Refuse features computed from a ``dataset.json`` that has since changed (the cheap sha256 check)."""
    dataset_dir = dataset_folder(folder, manifest.dataset_dir)  # only its dataset.json is read
    if not (dataset_dir / DATASET_FILE).exists():
        log.warning("%s: the dataset it was computed from (%s) is gone; cannot check freshness",
                    folder, dataset_dir)
        return
    problems = feature_staleness(folder, manifest, dataset_dir, deep=False)
    if problems:
        raise StaleCacheError(f"stale features: {problems[0].split(': stale: ', 1)[-1]}; rerun precompute-features",
                              path=str(Path(folder) / FEATURES_FILE))
