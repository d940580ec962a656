"""``shards verify``: does a dataset or feature folder, on this machine or under ``s3://``, still hold exactly what
its manifest says?

One implementation for every location (``shards.transport.location``): each shard is read once, a local file in
place, any other copied in one streaming read (at most one byte more than the manifest records) to a temporary
file. For image shards: every shard exists with the recorded size and sha256, its byte index (a tar's sidecar)
holds the offsets found by walking its headers, it reads to the end, holds the recorded number of samples with
in-range labels and unique keys, and the class counts add up; a spread sample of images per shard (every image
with ``full``) decodes (those sample checks are ``shards.check.verify_core``); the source index matches its
checksum. Feature folders are checked by ``shards.check.features_verify``. Every problem names the shard (and
sample key), so a corrupt file can be found and repacked. Shards are checked in worker processes (``workers``),
each returning what it found on its own; the dataset-wide checks (keys unique across shards, split totals) are made
here in shard order, so the report is the same for any number of workers.

Every file is opened through the one door (``shards.door.bounded_read``): a FIFO, device, socket, folder or link loop in
place of a shard, a sidecar or a column file is one problem line naming it, never a hang. The column index
(``shards.formats.columns``) is checked twice over: each file against the manifest's size and sha256, and the
fields verify can recompute from the samples it reads anyway (keys and labels) row by row against those samples,
as each shard's result comes in. A manifest's checksum only says the file is the one the manifest names; a column
edited by hand, its checksum fixed up to match, is caught by the second check.
"""

from __future__ import annotations

import hashlib
import os
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from shards.door.bounded_read import open_regular_file
from shards.check.verify_core import (
    DEFAULT_SAMPLES_PER_SHARD, ShardTally, Tally, VerifyOptions, VerifyReport, check_samples, check_split_totals,
)
from shards.errors import CorruptDataError, InputError, ManifestError, MissingInputError, ShardcacheError
from shards.select.columns import open_columns, verify_columns
from shards.transport.location import Location, locate
from shards.transport.manifest_io import load_manifest_at
from shards.transport.storage import get_storage
from shards.formats.tarseek import tar_sample_offsets
from shards.manifest import DATASET_FILE, DatasetManifest, ShardInfo
from shards.jobs.parallel import ordered_map
from shards.jobs.progress import progress


@dataclass(frozen=True)
class ShardJob:
    """One image shard to check: all a worker process needs (the location carries the caller's S3 options)."""

    base: Location
    storage: str
    n_classes: int
    shard: ShardInfo
    decode_wanted: int | None
    # Where the shards are, when not beside the manifest (``--source``: tars adopted in place); None: ``base``.
    shards_at: Location | None = None


HASH_BLOCK = 4 << 20


def _size_and_sha256(path: Path) -> tuple[int, str]:
    """The size and sha256 of a file opened through the one door: anything but a regular file raises
    ``CorruptDataError`` naming it (none at all: ``MissingInputError``), and nothing else is read of it."""
    with open_regular_file(path, error=CorruptDataError) as handle:
        digest = hashlib.sha256()
        while block := handle.read(HASH_BLOCK):
            digest.update(block)
        return os.fstat(handle.fileno()).st_size, digest.hexdigest()


def _check_bytes(path: Path, shard: ShardInfo, limit: int, tally: ShardTally) -> None:
    """Size and sha256 against the manifest (a copy that stopped at ``limit`` bytes is longer than recorded)."""
    size, digest = _size_and_sha256(path)
    if size != shard.bytes:
        shown = f"more than {shard.bytes}" if size == limit else str(size)
        tally.problem(f"{shard.path}: size {shown} bytes, manifest says {shard.bytes}")
    if digest != shard.sha256:
        tally.problem(f"{shard.path}: sha256 {digest[:16]}... does not match the manifest's {shard.sha256[:16]}...")


def _check_index(where: Location, path: Path, shard: ShardInfo, tally: ShardTally) -> None:
    """The tar sidecar: present, its sha256 and layout as the manifest says, and its offsets those of the shard."""
    try:
        offsets = where.load_index(shard)
        if offsets is None:
            tally.problem(f"{shard.index}: missing (the manifest names it)")
        elif offsets.tolist() != tar_sample_offsets(path):
            tally.problem(f"{shard.index}: offsets do not match the samples of {shard.path}")
    except ShardcacheError as exc:
        tally.problem(f"{shard.index}: {exc}")


def _load_rows(storage: Any, base: Location, shard: ShardInfo, tally: ShardTally) -> Any:
    """An adopted tar's row index (its size, sha256 and layout checked), or None with the problem recorded."""
    try:
        return storage.load_index(base, shard, where=str(base.file(DATASET_FILE)))
    except MissingInputError:
        tally.problem(f"{shard.index}: missing (the manifest names it)")
    except ShardcacheError as exc:
        tally.problem(f"{shard.index}: {exc}")
    return None


def check_shard(job: ShardJob) -> ShardTally:
    """Everything about one image shard that needs no other shard (run in a worker process with ``--workers``)."""
    shard, tally = job.shard, ShardTally(job.n_classes)
    storage = get_storage(job.storage)
    try:
        where = (job.base if job.shards_at is None else job.shards_at).child(shard.path)
    except ManifestError as exc:  # a symlink out of the folder: reported, never read
        tally.problem(str(exc))
        return tally
    limit = shard.bytes + 1
    try:
        with where.local_copy(limit) as path:
            _check_bytes(path, shard, limit, tally)
            rows = None
            if storage.load_index is not None:  # adopted tars: their row index is under the manifest's folder
                rows = _load_rows(storage, job.base, shard, tally)
                if rows is None:
                    return tally
            elif shard.index is not None and storage.indexed:
                _check_index(where, path, shard, tally)
            check_samples(path, job.storage, shard, job.decode_wanted, tally, offsets=rows)
    except MissingInputError:
        tally.problem(f"{shard.path}: missing")
    except InputError:
        raise  # 403, or no credentials: nothing else will read either
    except ShardcacheError as exc:  # the read broke off (the network, after its retries)
        tally.problem(f"{shard.path}: {exc.reason}")
    return tally


def _check_source_index(base: Location, manifest: DatasetManifest, tally: Tally) -> None:
    """The source index the manifest names (what subsets filter by): inside the folder, present, its sha256."""
    entry = manifest.extra.get("source_index")
    if not isinstance(entry, Mapping) or entry.get("path") is None:
        return
    name = str(entry["path"]).rsplit("/", 1)[-1]
    try:
        where = base.child(entry["path"], where=str(base.file(DATASET_FILE)), what="source index")
        with where.local_copy() as path:
            recorded = entry.get("sha256")
            digest = _size_and_sha256(path)[1]  # through the door even when no checksum is recorded
            if recorded and digest != recorded:
                tally.problems.append(f"{name}: source index does not match the checksum in dataset.json")
    except ManifestError as exc:  # a name or symlink out of the folder: reported, never read
        tally.problems.append(str(exc))
    except MissingInputError:
        tally.problems.append(f"{name}: missing (the manifest names it as the source index)")
    except CorruptDataError as exc:  # a FIFO, a folder... in its place
        tally.problems.append(f"{name}: {exc.reason}")


class _IndexedFields:
    """A split's key and label columns, held row by row to the samples its shards hold, one shard at a time in
    manifest order (the column's row order). Columns that fail their own checks, or a dataset without columns,
    give nothing to compare: ``verify_columns`` reports the former."""

    FIELDS = ("key", "label")

    def __init__(self, base: Location, manifest: DatasetManifest, split: str):
        self.row = 0  # the split's row of the next shard's first sample
        self.fields: list[tuple[str, str, Any]] = []  # (field, its column file, its values)
        try:
            columns = open_columns(base, manifest, split)
            if columns is not None:
                self.fields = [(name, columns.path_of(name), columns.column(name)) for name in self.FIELDS]
        except (ShardcacheError, KeyError):
            self.fields = []

    def check(self, shard: ShardInfo, read: ShardTally) -> list[str]:
        """One line per field whose column disagrees with ``shard`` (the split's next one), naming the first row
        that does; nothing when the shard did not read whole (already a problem, and its rows would not align)."""
        first, self.row = self.row, self.row + shard.samples
        if not self.fields or len(read.keys) != shard.samples:
            return []
        problems = []
        for name, column_path, values in self.fields:
            recorded = values[first:first + shard.samples].tolist()
            found = [key.encode("utf-8") for key in read.keys] if name == "key" else read.labels
            wrong = [i for i, (mine, theirs) in enumerate(zip(recorded, found)) if mine != theirs]
            if wrong:
                i = wrong[0]
                more = f"; {len(wrong) - 1} more of its rows differ" if len(wrong) > 1 else ""
                problems.append(f"{column_path}: row {first + i} (sample {read.keys[i]}): {name} {_shown(recorded[i])} "
                                f"in the column index, {_shown(found[i])} in {shard.path}{more}")
        return problems


def _shown(value: Any) -> str:
    return repr(value.decode("utf-8", "replace")) if isinstance(value, bytes) else str(value)


def _verify_images(shown: str, base: Location, manifest: DatasetManifest, options: VerifyOptions,
                   shards_at: Location | None = None) -> VerifyReport:
    tally = Tally(len(manifest.classes))
    decode_wanted = None if options.full else options.samples_per_shard
    jobs = [ShardJob(base, manifest.storage, len(manifest.classes), shard, decode_wanted, shards_at)
            for split in manifest.splits.values() for shard in split.shards]
    with progress(total=len(jobs), desc="verify", unit="shard", quiet=options.quiet) as bar, \
            closing(ordered_map(check_shard, jobs, options.workers, lambda _: bar.update(1))) as results:
        disagreements: list[str] = []  # reported after the shards' own problems, which the totals check counts
        for split_name, split in manifest.splits.items():
            indexed = _IndexedFields(base, manifest, split_name)
            for shard, result in zip(split.shards, results):
                tally.add(split_name, shard.path, result)
                disagreements += indexed.check(shard, result)
            check_split_totals(split_name, split, tally)
    tally.problems.extend(disagreements)
    _check_source_index(base, manifest, tally)
    tally.problems.extend(verify_columns(base, manifest))  # the column index (shards.formats.columns)
    return VerifyReport(shown, "images", tuple(tally.problems), len(jobs), tally.read, tally.decoded)


def verify_dataset(folder: str | os.PathLike, *, full: bool = False,
                   samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD, storage_options: Any = None,
                   workers: int = 1, quiet: bool = False, source: str | None = None) -> VerifyReport:
    """Check a dataset (``dataset.json``) or feature (``features.json``) folder against its manifest; ``folder``
    may be ``s3://bucket/prefix`` (reached with ``storage_options``). ``workers`` processes check shards side by
    side (the report is the one a single process makes); a progress bar counts shards on stderr unless ``quiet``.
    ``source``: where the shards are when not beside the manifest (the tars of an index made by ``shards index``;
    the manifest's names are resolved under it, confined there); the row indexes and columns stay the folder's."""
    options = VerifyOptions(full, samples_per_shard, workers, quiet)
    manifest, base = load_manifest_at(folder, storage_options=storage_options)
    where = locate(base, storage_options=storage_options)
    if manifest.kind == "features":
        from shards.check.features_verify import verify_feature_folder  # written with the features stage

        problems = verify_feature_folder(where, full=full, workers=workers, quiet=quiet, source=source)
        shards = sum(len(s.shards) for s in manifest.splits.values())
        return VerifyReport(str(folder), "features", tuple(problems), shards)
    adopted = get_storage(manifest.storage).load_index is not None
    if adopted and source is None:
        raise InputError("indexes tars adopted in place (shards index): give --source, the folder holding them",
                         path=str(folder))
    shards_at = None if source is None else locate(source, storage_options=storage_options)
    return _verify_images(str(folder), where, manifest, options, shards_at)
