"""``shards verify``: does a folder still hold exactly what its manifest says?

For image shards: every shard exists with the recorded size and sha256, reads to the end, holds the recorded
number of samples with in-range labels and unique keys, and the class counts add up; a spread sample of images per
shard (every image with ``full``) decodes (those sample checks are ``shards.check.verify_core``, shared with
``shards.check.s3_verify``). Feature folders are checked by ``shards.check.features_verify``. Every problem names
the shard (and sample key), so a corrupt file can be found and repacked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shards.atomic import sha256_file
from shards.check.verify_core import (
    DEFAULT_SAMPLES_PER_SHARD, Tally, VerifyReport, check_samples, check_split_totals,
)
from shards.errors import CorruptDataError, ManifestError
from shards.formats.locations import local_shard_path
from shards.manifest import DatasetManifest, ShardInfo, load_manifest
from shards.formats.tarindex import load_local_index
from shards.formats.tarseek import tar_sample_offsets
from shards.stream.rows import source_index_path


def _check_file(folder: Path, shard: ShardInfo, tally: Tally) -> bool:
    try:
        path = local_shard_path(folder, shard.path)
    except ManifestError as exc:  # a symlink out of the folder: reported, never read
        tally.problems.append(str(exc))
        return False
    if not path.is_file():
        tally.problems.append(f"{shard.path}: missing")
        return False
    size = path.stat().st_size
    if size != shard.bytes:
        tally.problems.append(f"{shard.path}: size {size} bytes, manifest says {shard.bytes}")
    digest = sha256_file(path)
    if digest != shard.sha256:
        tally.problems.append(f"{shard.path}: sha256 {digest[:16]}... does not match the manifest's "
                              f"{shard.sha256[:16]}...")
    if shard.index is not None:
        _check_index(path, shard, tally)
    return True


def _check_index(path: Path, shard: ShardInfo, tally: Tally) -> None:
    """The tar sidecar: present, its sha256 and layout as the manifest says, and its offsets those of the shard."""
    try:
        offsets = load_local_index(path, shard)
        if offsets is None:
            tally.problems.append(f"{shard.index}: missing (the manifest names it)")
        elif offsets.tolist() != tar_sample_offsets(path):
            tally.problems.append(f"{shard.index}: offsets do not match the samples of {shard.path}")
    except (CorruptDataError, ManifestError) as exc:
        tally.problems.append(f"{shard.index}: {exc}")


def _check_source_index(folder: Path, manifest: DatasetManifest, tally: Tally) -> None:
    """The source index the manifest names (what subsets filter by): inside the folder, present, its sha256."""
    try:
        path = source_index_path(folder, manifest)
    except ManifestError as exc:  # a name or symlink out of the folder: reported, never read
        tally.problems.append(str(exc))
        return
    if path is None:
        return
    recorded = manifest.extra["source_index"].get("sha256")
    if not path.is_file():
        tally.problems.append(f"{path.name}: missing (the manifest names it as the source index)")
    elif recorded and sha256_file(path) != recorded:
        tally.problems.append(f"{path.name}: source index does not match the checksum in dataset.json")


def _verify_images(folder: Path, manifest: DatasetManifest, full: bool, samples_per_shard: int) -> VerifyReport:
    tally = Tally(len(manifest.classes))
    shards_checked = 0
    for split_name, split in manifest.splits.items():
        for shard in split.shards:
            shards_checked += 1
            if _check_file(folder, shard, tally):
                check_samples(folder, manifest.storage, split_name, shard, None if full else samples_per_shard,
                               tally)
        check_split_totals(split_name, split, tally)
    _check_source_index(folder, manifest, tally)
    return VerifyReport(str(folder), "images", tuple(tally.problems), shards_checked, tally.read, tally.decoded)


def verify_dataset(folder: str | os.PathLike, *, full: bool = False,
                   samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD, storage_options: Any = None) -> VerifyReport:
    """Check a dataset (``dataset.json``) or feature (``features.json``) folder against its manifest; ``folder``
    may be ``s3://bucket/prefix`` (``shards.check.s3_verify``)."""
    if str(folder).startswith("s3://"):
        from shards.check.s3_verify import verify_s3

        return verify_s3(str(folder), full=full, samples_per_shard=samples_per_shard,
                         storage_options=storage_options)
    folder = Path(folder)
    manifest = load_manifest(folder)
    if manifest.kind == "features":
        from shards.check.features_verify import verify_feature_folder  # written with the features stage

        problems = verify_feature_folder(folder, full=full)
        shards = sum(len(s.shards) for s in manifest.splits.values())
        return VerifyReport(str(folder), "features", tuple(problems), shards)
    return _verify_images(folder, manifest, full, samples_per_shard)
