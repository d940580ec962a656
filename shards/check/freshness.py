"""Is a feature cache still the features of its dataset? The one staleness rule, for every stage that asks.

Features are stale when what they were computed from has changed: the source ``dataset.json`` (its sha256 is
recorded in ``features.json``), a split or image shard that is gone, an image shard whose sha256 differs from the
one recorded per feature shard, or image shards added since that have no features yet. ``shards verify`` lists
every such problem (``feature_staleness``), ``train-from-shards`` refuses to start on the first
(``check_features_fresh``), and ``precompute-features`` recomputes a shard whose source changed
(``shard_staleness``).

The dataset may be on object storage (``dataset_dir`` is ``s3://bucket/prefix``): its ``dataset.json`` is then read
with the caller's storage options and hashed as bytes; nothing else of it is read (``dataset_location`` in
``shards.formats.locations`` says when such a URL is followed at all). A dataset that cannot be reached (gone,
403, 404, network) is a warning for ``check_features_fresh``, as a deleted local one is.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from shards.bounded_read import JSONError, parse_json
from shards.errors import ManifestError, ShardcacheError, StaleCacheError
from shards.formats.feature_names import from_table
from shards.formats.locations import dataset_location
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


def _is_s3(location: object) -> bool:
    return str(location).startswith("s3://")


def _join(folder: str | os.PathLike, name: str) -> str:
    """``folder/name`` for messages; an ``s3://`` folder stays a URL (``Path`` would fold its ``//``)."""
    return f"{str(folder).rstrip('/')}/{name}" if _is_s3(folder) else str(Path(folder) / name)


def read_s3_dataset(url: str, storage_options: Any = None) -> tuple[DatasetManifest, str]:
    """The ``dataset.json`` under ``s3://bucket/prefix`` and the sha256 of its bytes (one GET: the manifest and its
    digest come from the same bytes). Shard paths in it must be relative names (no URLs, no ``pipe:``)."""
    from shards.formats.s3 import S3Options
    from shards.formats.s3_ranges import read_object

    where = _join(url, DATASET_FILE)
    payload = read_object(where, S3Options.from_mapping(storage_options))
    try:
        data = parse_json(payload)
    except JSONError as exc:
        raise ManifestError(str(exc), path=where) from None
    return DatasetManifest.from_dict(data, where=where), hashlib.sha256(payload).hexdigest()


def dataset_sha256_at(dataset_dir: str | os.PathLike, storage_options: Any = None) -> str:
    """The sha256 of the ``dataset.json`` bytes in a local folder or under an ``s3://`` prefix."""
    if _is_s3(dataset_dir):
        from shards.formats.s3 import S3Options
        from shards.formats.s3_ranges import read_object

        payload = read_object(_join(dataset_dir, DATASET_FILE), S3Options.from_mapping(storage_options))
        return hashlib.sha256(payload).hexdigest()
    return dataset_manifest_sha256(dataset_dir)


def feature_staleness(folder: str | Path, manifest: FeatureManifest, dataset_dir: str | Path,
                      dataset: DatasetManifest | None = None, *, deep: bool = True,
                      storage_options: Any = None) -> list[str]:
    """Every reason the features in ``folder`` are stale against the dataset in ``dataset_dir`` ([] if fresh).

    The dataset.json sha256 comparison always runs; ``deep`` also names the splits and shards that changed, reading
    ``dataset`` (or ``dataset_dir``'s dataset.json). Each reason is one line starting with the path concerned.
    ``folder`` and ``dataset_dir`` may be ``s3://`` prefixes (read with ``storage_options``).
    """
    problems = []
    if _is_s3(dataset_dir) and deep and dataset is None:
        dataset, current = read_s3_dataset(str(dataset_dir), storage_options)
    else:
        current = dataset_sha256_at(dataset_dir, storage_options)
    if current != manifest.dataset_sha256:
        problems.append(f"{folder}: stale: {_join(dataset_dir, DATASET_FILE)} changed since the features were "
                        f"computed (sha256 {manifest.dataset_sha256[:12]}... then, {current[:12]}... now)")
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
                problems.append(f"{_join(folder, info.path)}: stale: {reason}")
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
    if not _is_s3(location) and not (Path(location) / DATASET_FILE).exists():
        log.warning("%s: the dataset it was computed from (%s) is gone; cannot check freshness",
                    folder, location)
        return
    try:
        problems = feature_staleness(folder, manifest, location, deep=False, storage_options=storage_options)
    except ShardcacheError as exc:
        if not _is_s3(location):
            raise
        log.warning("%s: cannot check freshness: the dataset it was computed from is unreachable (%s)", folder,
                    " ".join(str(exc).split()))
        return
    if problems:
        raise StaleCacheError(f"stale features: {problems[0].split(': stale: ', 1)[-1]}; rerun precompute-features",
                              path=_join(folder, FEATURES_FILE))


def staleness_or_warn(folder: str | Path, manifest: FeatureManifest, *, storage_options: Any = None,
                      dataset_dir: str | os.PathLike | None = None) -> list[str]:
    """``feature_staleness`` (deep) against the dataset ``dataset_location`` follows, for ``shards verify`` of a
    feature folder on ``s3://``: [] with a warning when that dataset is not followed or cannot be reached."""
    if from_table(manifest.config):
        return []
    location, why_not = dataset_location(folder, manifest.dataset_dir, dataset_dir)
    if location is None:
        log.warning("%s: cannot check staleness: %s", folder, why_not)
        return []
    try:
        return feature_staleness(folder, manifest, location, storage_options=storage_options)
    except ShardcacheError as exc:
        log.warning("%s: cannot check staleness: the dataset it was computed from is unreadable (%s)", folder,
                    " ".join(str(exc).split()))
        return []
