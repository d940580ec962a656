"""``shards verify``: does a folder still hold exactly what its manifest says?

For image shards: every shard exists with the recorded size and sha256, reads to the end, holds the recorded
number of samples with in-range labels and unique keys, and the class counts add up; a spread sample of images per
shard (every image with ``full``) decodes. Feature folders are checked by ``shards.check.features_verify``. Every
problem names the shard (and sample key), so a corrupt file can be found and repacked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shards.atomic import sha256_file
from shards.image.decode import decode_image
from shards.errors import CorruptDataError, ManifestError
from shards.formats.locations import local_shard_path
from shards.formats.sample import label_problem
from shards.manifest import DatasetManifest, ShardInfo, load_manifest
from shards.formats.storage import get_storage
from shards.formats.tarindex import load_local_index
from shards.formats.tarseek import tar_sample_offsets
from shards.stream.rows import source_index_path

DEFAULT_SAMPLES_PER_SHARD = 4


@dataclass(frozen=True)
class VerifyReport:
    folder: str
    kind: str  # "images" or "features"
    problems: tuple[str, ...]
    shards_checked: int = 0
    samples_read: int = 0
    samples_decoded: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"folder": self.folder, "kind": self.kind, "ok": self.ok, "problems": list(self.problems),
                "shards_checked": self.shards_checked, "samples_read": self.samples_read,
                "samples_decoded": self.samples_decoded}


def decode_positions(count: int, wanted: int) -> set[int]:
    """Which samples to decode: evenly spread, always the first and last, the same on every run."""
    if wanted <= 0 or count <= 0:
        return set()
    if wanted >= count:
        return set(range(count))
    if wanted == 1:
        return {0}
    return {round(i * (count - 1) / (wanted - 1)) for i in range(wanted)}


class _Tally:
    def __init__(self, n_classes: int):
        self.problems: list[str] = []
        self.class_counts: dict[str, list[int]] = {}
        self.keys: dict[str, str] = {}
        self.read = 0
        self.decoded = 0
        self.n_classes = n_classes


def _check_file(folder: Path, shard: ShardInfo, tally: _Tally) -> bool:
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


def _check_index(path: Path, shard: ShardInfo, tally: _Tally) -> None:
    """The tar sidecar: present, its sha256 and layout as the manifest says, and its offsets those of the shard."""
    try:
        offsets = load_local_index(path, shard)
        if offsets is None:
            tally.problems.append(f"{shard.index}: missing (the manifest names it)")
        elif offsets.tolist() != tar_sample_offsets(path):
            tally.problems.append(f"{shard.index}: offsets do not match the samples of {shard.path}")
    except (CorruptDataError, ManifestError) as exc:
        tally.problems.append(f"{shard.index}: {exc}")


def _check_samples(folder: Path, storage: str, split: str, shard: ShardInfo, decode_wanted: int | None,
                   tally: _Tally, samples: Any = None) -> None:
    """``samples``: the shard's samples when they come from elsewhere (object storage), else read from ``folder``."""
    counts = tally.class_counts.setdefault(split, [0] * tally.n_classes)
    positions = None if decode_wanted is None else decode_positions(shard.samples, decode_wanted)
    seen, last_key = 0, None
    own = [0] * tally.n_classes  # this shard's, against its recorded class_counts (what subsets skip shards by)
    try:
        if samples is None:
            samples = get_storage(storage).read(local_shard_path(folder, shard.path))
        for position, sample in enumerate(samples):
            seen, last_key = seen + 1, sample.key
            where = f"{shard.path} [sample {sample.key}]"
            if sample.key in tally.keys:
                tally.problems.append(f"{where}: key also in {tally.keys[sample.key]}")
            tally.keys[sample.key] = shard.path
            # The range only: the shard's recorded class counts are compared whole below (one line, not one a sample).
            problem = label_problem(sample.label, tally.n_classes)
            if problem is not None:
                tally.problems.append(f"{where}: {problem}")
            if 0 <= sample.label < tally.n_classes:
                counts[sample.label] += 1
                own[sample.label] += 1
            if positions is None or position in positions:
                try:
                    decode_image(sample.data)
                    tally.decoded += 1
                except Exception as exc:  # any decoder failure is corruption worth naming
                    tally.problems.append(f"{where}: image does not decode ({type(exc).__name__}: {exc})")
    except CorruptDataError as exc:
        where = shard.path if last_key is None else f"{shard.path} [after sample {last_key}]"
        tally.problems.append(f"{where}: unreadable after {seen} samples ({exc})")
    tally.read += seen
    if seen != shard.samples:
        tally.problems.append(f"{shard.path}: holds {seen} samples, manifest says {shard.samples}")
    elif shard.class_counts is not None and list(shard.class_counts) != own:
        tally.problems.append(f"{shard.path}: class counts {own} differ from the manifest's per-shard "
                              f"{list(shard.class_counts)}")


def _check_source_index(folder: Path, manifest: DatasetManifest, tally: _Tally) -> None:
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


def check_split_totals(split_name: str, split: Any, tally: _Tally) -> None:
    """The split's own totals against its shards and the labels read (class counts only when nothing else failed,
    so one damaged shard is not reported twice)."""
    if sum(s.samples for s in split.shards) != split.samples:
        tally.problems.append(f"split {split_name}: shard sample counts do not add up to {split.samples}")
    counted = tally.class_counts.get(split_name)
    if counted is not None and tuple(counted) != tuple(split.class_counts) and not tally.problems:
        tally.problems.append(f"split {split_name}: class counts {counted} differ from the manifest's "
                              f"{list(split.class_counts)}")


def _verify_images(folder: Path, manifest: DatasetManifest, full: bool, samples_per_shard: int) -> VerifyReport:
    tally = _Tally(len(manifest.classes))
    shards_checked = 0
    for split_name, split in manifest.splits.items():
        for shard in split.shards:
            shards_checked += 1
            if _check_file(folder, shard, tally):
                _check_samples(folder, manifest.storage, split_name, shard, None if full else samples_per_shard,
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
