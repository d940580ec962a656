"""Is a feature cache still the features of its dataset? The one staleness rule, for every stage that asks.

Features are stale when what they were computed from has changed: the source ``dataset.json`` (its sha256 is
recorded in ``features.json``), a split or image shard that is gone, an image shard whose sha256 differs from the
one recorded per feature shard, or image shards added since that have no features yet. ``shards verify`` lists
every such problem (``feature_staleness``), ``train-from-shards`` refuses to start on the first
(``check_features_fresh``), and ``precompute-features`` recomputes a shard whose source changed
(``shard_staleness``).

The dataset may be on object storage (``dataset_dir`` is ``s3://bucket/prefix``): its ``dataset.json`` is then read
with the caller's storage options (``shards.transport.manifest_io``); nothing else of it is read
(``dataset_location`` in ``shards.door.locations`` says when such a URL is followed at all). A dataset that is
gone or cannot be reached (403, 404, network) is a warning for ``check_features_fresh``; a ``dataset.json`` that
is there but malformed is an error.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

from shards.errors import ManifestError, ShardcacheError, StaleCacheError
from shards.formats.feature_names import from_table
from shards.transport.location import Location, locate
from shards.door.locations import dataset_location
from shards.transport.manifest_io import dataset_sha256_at, read_dataset_manifest
from shards.manifest import DATASET_FILE, FEATURES_FILE, DatasetManifest, FeatureManifest, ShardInfo

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


def feature_staleness(folder: str | Path | Location, manifest: FeatureManifest, dataset_dir: str | Path | Location,
                      dataset: DatasetManifest | None = None, *, deep: bool = True,
                      storage_options: Any = None) -> list[str]:
    """Every reason the features in ``folder`` are stale against the dataset in ``dataset_dir`` ([] if fresh).

    The dataset.json sha256 comparison always runs; ``deep`` also names the splits and shards that changed, reading
    ``dataset`` (or ``dataset_dir``'s dataset.json). Each reason is one line starting with the path concerned.
    ``folder`` and ``dataset_dir`` may be ``s3://`` prefixes (read with ``storage_options``).
    """
    problems = []
    source = locate(dataset_dir, storage_options=storage_options)
    if deep and dataset is None:  # the manifest and its digest from the same bytes
        dataset, current = read_dataset_manifest(source)
    else:
        current = dataset_sha256_at(source)
    if current != manifest.dataset_sha256:
        problems.append(f"{folder}: stale: {source.file(DATASET_FILE)} changed since the features were "
                        f"computed (sha256 {manifest.dataset_sha256[:12]}... then, {current[:12]}... now)")
    if not deep:
        return problems
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
                problems.append(f"{locate(folder).file(info.path)}: stale: {reason}")
        new = [path for path in sources if path not in covered]
        if new:
            problems.append(f"{folder}: stale: split {name!r} has {len(new)} image shard(s) without features "
                            f"(e.g. {new[0]}); rerun precompute-features to add them")
    return problems


def check_features_fresh(folder: str | Path, manifest: FeatureManifest, *, storage_options: Any = None,
                         dataset_dir: str | os.PathLike | None = None) -> None:
    """Refuse features computed from a ``dataset.json`` that has since changed (the cheap sha256 check).

    ``dataset_dir``: the caller's own location of the source dataset (else the recorded one, see
    ``dataset_location``); ``storage_options``: how to reach ``s3://`` ones. A dataset that is gone or cannot be
    reached is a warning, not an error."""
    if from_table(manifest.config):
        return
    location, why_not = dataset_location(folder, manifest.dataset_dir, dataset_dir)
    if location is None:
        log.warning("%s: cannot check freshness: %s", folder, why_not)
        return
    try:
        problems = feature_staleness(folder, manifest, location, deep=False, storage_options=storage_options)
    except ManifestError:
        raise  # there but malformed, or too large for a manifest: an error, as for any manifest
    except ShardcacheError as exc:  # gone (a deleted folder, 404), refused (403) or unreachable
        log.warning("%s: cannot check freshness: the dataset it was computed from (%s) is gone or unreachable (%s)",
                    folder, location, " ".join(str(exc).split()))
        return
    if problems:
        raise StaleCacheError(f"stale features: {problems[0].split(': stale: ', 1)[-1]}; rerun precompute-features",
                              path=str(locate(folder).file(FEATURES_FILE)))
