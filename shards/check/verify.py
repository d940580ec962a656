"""``shards verify``: does a dataset or feature folder, on this machine or under ``s3://``, still hold exactly what
its manifest says?

One implementation for every location (``shards.formats.location``): each shard is read once, a local file in
place, any other copied in one streaming read (at most one byte more than the manifest records) to a temporary
file. For image shards: every shard exists with the recorded size and sha256, its byte index (a tar's sidecar)
holds the offsets found by walking its headers, it reads to the end, holds the recorded number of samples with
in-range labels and unique keys, and the class counts add up; a spread sample of images per shard (every image
with ``full``) decodes (those sample checks are ``shards.check.verify_core``); the source index matches its
checksum. Feature folders are checked by ``shards.check.features_verify``. Every problem names the shard (and
sample key), so a corrupt file can be found and repacked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from shards.atomic import sha256_file
from shards.check.verify_core import (
    DEFAULT_SAMPLES_PER_SHARD, Tally, VerifyReport, check_samples, check_split_totals,
)
from shards.errors import InputError, ManifestError, MissingInputError, ShardcacheError
from shards.formats.location import Location, locate
from shards.formats.manifest_io import load_manifest_at
from shards.formats.storage import get_storage
from shards.formats.tarseek import tar_sample_offsets
from shards.manifest import DATASET_FILE, DatasetManifest, ShardInfo


def _check_bytes(path: Path, shard: ShardInfo, limit: int, tally: Tally) -> None:
    """Size and sha256 against the manifest (a copy that stopped at ``limit`` bytes is longer than recorded)."""
    size = path.stat().st_size
    if size != shard.bytes:
        shown = f"more than {shard.bytes}" if size == limit else str(size)
        tally.problems.append(f"{shard.path}: size {shown} bytes, manifest says {shard.bytes}")
    digest = sha256_file(path)
    if digest != shard.sha256:
        tally.problems.append(f"{shard.path}: sha256 {digest[:16]}... does not match the manifest's "
                              f"{shard.sha256[:16]}...")


def _check_index(where: Location, path: Path, shard: ShardInfo, tally: Tally) -> None:
    """The tar sidecar: present, its sha256 and layout as the manifest says, and its offsets those of the shard."""
    try:
        offsets = where.load_index(shard)
        if offsets is None:
            tally.problems.append(f"{shard.index}: missing (the manifest names it)")
        elif offsets.tolist() != tar_sample_offsets(path):
            tally.problems.append(f"{shard.index}: offsets do not match the samples of {shard.path}")
    except ShardcacheError as exc:
        tally.problems.append(f"{shard.index}: {exc}")


def _check_shard(base: Location, storage: str, split_name: str, shard: ShardInfo, decode_wanted: int | None,
                 tally: Tally) -> None:
    try:
        where = base.child(shard.path)
    except ManifestError as exc:  # a symlink out of the folder: reported, never read
        tally.problems.append(str(exc))
        return
    limit = shard.bytes + 1
    try:
        with where.local_copy(limit) as path:
            if not path.is_file():
                raise MissingInputError("missing", path=where.text)
            _check_bytes(path, shard, limit, tally)
            if shard.index is not None and get_storage(storage).indexed:
                _check_index(where, path, shard, tally)
            check_samples(path, storage, split_name, shard, decode_wanted, tally)
    except MissingInputError:
        tally.problems.append(f"{shard.path}: missing")
    except InputError:
        raise  # 403, or no credentials: nothing else will read either
    except ShardcacheError as exc:  # the read broke off (the network, after its retries)
        tally.problems.append(f"{shard.path}: {exc.reason}")


def _check_source_index(base: Location, manifest: DatasetManifest, tally: Tally) -> None:
    """The source index the manifest names (what subsets filter by): inside the folder, present, its sha256."""
    entry = manifest.extra.get("source_index")
    if not isinstance(entry, Mapping) or entry.get("path") is None:
        return
    name = str(entry["path"]).rsplit("/", 1)[-1]
    try:
        where = base.child(entry["path"], where=str(base.file(DATASET_FILE)), what="source index")
        with where.local_copy() as path:
            if not path.is_file():
                raise MissingInputError("missing", path=where.text)
            recorded = entry.get("sha256")
            if recorded and sha256_file(path) != recorded:
                tally.problems.append(f"{name}: source index does not match the checksum in dataset.json")
    except ManifestError as exc:  # a name or symlink out of the folder: reported, never read
        tally.problems.append(str(exc))
    except MissingInputError:
        tally.problems.append(f"{name}: missing (the manifest names it as the source index)")


def _verify_images(shown: str, base: Location, manifest: DatasetManifest, full: bool,
                   samples_per_shard: int) -> VerifyReport:
    tally = Tally(len(manifest.classes))
    shards_checked = 0
    for split_name, split in manifest.splits.items():
        for shard in split.shards:
            shards_checked += 1
            _check_shard(base, manifest.storage, split_name, shard, None if full else samples_per_shard, tally)
        check_split_totals(split_name, split, tally)
    _check_source_index(base, manifest, tally)
    return VerifyReport(shown, "images", tuple(tally.problems), shards_checked, tally.read, tally.decoded)


def verify_dataset(folder: str | os.PathLike, *, full: bool = False,
                   samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD, storage_options: Any = None) -> VerifyReport:
    """Check a dataset (``dataset.json``) or feature (``features.json``) folder against its manifest; ``folder``
    may be ``s3://bucket/prefix`` (reached with ``storage_options``)."""
    manifest, base = load_manifest_at(folder, storage_options=storage_options)
    where = locate(base, storage_options=storage_options)
    if manifest.kind == "features":
        from shards.check.features_verify import verify_feature_folder  # written with the features stage

        problems = verify_feature_folder(where, full=full)
        shards = sum(len(s.shards) for s in manifest.splits.values())
        return VerifyReport(str(folder), "features", tuple(problems), shards)
    return _verify_images(str(folder), where, manifest, full, samples_per_shard)
