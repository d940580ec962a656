"""``shards verify s3://bucket/prefix``: the checks of ``shards.check.verify_core`` on a dataset in object storage.

Each shard is read in one streaming GET (retried and resumed, ``shards.formats.s3``), its size and sha256 checked
on the way, and its samples parsed from those bytes: tar as a stream, HDF5 from memory (one shard at a time), so
nothing is fetched twice. A tar shard's byte index is checked against the offsets found by walking its headers.
Feature folders: every feature file's size, sha256 and content, and staleness against the source dataset recorded
in ``features.json`` (an ``s3://`` one read with the same options, only its ``dataset.json``; a warning when it
cannot be reached, ``shards.check.freshness.staleness_or_warn``).
"""

from __future__ import annotations

from typing import Any

from shards.check.freshness import staleness_or_warn
from shards.check.verify_core import (
    DEFAULT_SAMPLES_PER_SHARD, Tally, VerifyReport, check_samples, check_split_totals,
)
from shards.errors import InputError, ShardcacheError
from shards.formats.features import FeatureSpec, feature_shard_problems, load_feature_bytes
from shards.formats.locations import shard_location
from shards.formats.s3 import S3Options
from shards.formats.s3shards import fetch_checked, load_s3_index
from shards.formats.storage import get_storage
from shards.manifest import DatasetManifest, FeatureManifest


def _samples(storage: str, data: bytes, where: str):
    return get_storage(storage).read_bytes(data, where)


def _check_index(location: str, shard: Any, data: bytes, options: S3Options, tally: Tally) -> None:
    import tempfile

    from shards.formats.tarseek import tar_sample_offsets

    try:
        offsets = load_s3_index(location, shard, options)
        with tempfile.NamedTemporaryFile(suffix=".tar") as handle:  # the header walk reads a file
            handle.write(data)
            handle.flush()
            if offsets.tolist() != tar_sample_offsets(handle.name):
                tally.problems.append(f"{shard.index}: offsets do not match the samples of {shard.path}")
    except ShardcacheError as exc:
        tally.problems.append(f"{shard.index}: {exc}")


def _verify_images(url: str, base: str, manifest: DatasetManifest, full: bool, samples_per_shard: int,
                   options: S3Options) -> VerifyReport:
    tally = Tally(len(manifest.classes))
    shards_checked = 0
    for split_name, split in manifest.splits.items():
        for shard in split.shards:
            shards_checked += 1
            location = shard_location(base, shard.path)
            try:
                data = fetch_checked(location, shard.bytes, shard.sha256, options)
            except InputError:
                raise  # 403, or no credentials: nothing else will read either
            except ShardcacheError as exc:
                tally.problems.append(f"{shard.path}: {exc.reason}")
                continue
            if getattr(shard, "index", None) is not None and get_storage(manifest.storage).indexed:
                _check_index(location, shard, data, options, tally)
            check_samples(None, manifest.storage, split_name, shard, None if full else samples_per_shard, tally,
                           samples=_samples(manifest.storage, data, location))
        check_split_totals(split_name, split, tally)
    return VerifyReport(url, "images", tuple(tally.problems), shards_checked, tally.read, tally.decoded)


def _verify_features(url: str, base: str, manifest: FeatureManifest, options: S3Options) -> VerifyReport:
    problems: list[str] = []
    spec = FeatureSpec.of(manifest)
    count = 0
    for split in manifest.splits.values():
        for info in split.shards:
            count += 1
            location = shard_location(base, info.path)
            try:
                shard = load_feature_bytes(fetch_checked(location, info.bytes, info.sha256, options), location)
            except InputError:
                raise
            except ShardcacheError as exc:
                problems.append(str(exc))
                continue
            problems.extend(f"{location}: {p}" for p in feature_shard_problems(shard, info.samples, spec))
            if len(set(shard.keys)) != len(shard.keys):
                problems.append(f"{location}: duplicate keys")
    problems.extend(staleness_or_warn(base, manifest, storage_options=options))
    return VerifyReport(url, "features", tuple(problems), count)


def verify_s3(url: str, *, full: bool = False, samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD,
              storage_options: Any = None) -> VerifyReport:
    from shards.stream.reader import load_s3_manifest

    options = S3Options.from_mapping(storage_options)
    manifest, base = load_s3_manifest(url, storage_options=options)
    if isinstance(manifest, FeatureManifest):
        return _verify_features(url, base, manifest, options)
    return _verify_images(url, base, manifest, full, samples_per_shard, options)
