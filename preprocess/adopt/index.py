"""``shards index``: adopt WebDataset tars in place. Everything shardcache needs to stream them is written under
``INDEX``; the tars are only read.

Layout inside ``INDEX/``::

    dataset.json                  the manifest (``storage: "wds"``): classes, splits of tars named by their path
                                  relative to the source's base, each with its size, sha256, class counts and row
                                  index; ``source.skipped``: the samples refused, with their reasons (as
                                  ``pack-shards`` lists them: the first 1,000 of a run by name, the rest counted
                                  per tar); ``adoption``: each tar's size, sha256 and version as indexed (what an
                                  incremental run compares: ``mtime_ns`` for a local tar, ``etag`` and
                                  ``last_modified`` for an object)
    .adopt/<n>.jsonl              while a run scans: each new tar's accepted samples (removed once committed)
    .adopt/<n>.tar                while a remote tar is scanned: its copy, from one streaming read (then removed)
    <tar path>.rows               each tar's row index (``shards.formats.adopted``): where each accepted sample's
                                  members start and end, its label, its key and the checksum of its bytes
    source-index-<n>.jsonl        one row per accepted sample (key, label, split, shard, row, metadata)
    columns/<split>/c000.npy...   the column index built from it (keys, labels, the ``.json`` members' scalars)

The index names tars by relative path only: where they are read from is the caller's choice when reading
(``Remote(base_url=SOURCE)``, ``--source``), as the trust model wants (docs/design.md, section 6).

The source may be local, an ``s3://`` prefix or pattern, or an ``http(s)://`` pattern
(``preprocess.adopt.sources``).

Incremental (like ``pack-shards --append``): a rerun into the same ``INDEX`` indexes only tars it has not seen. A
tar it has seen is checked by size, then rehashed whatever its version says (an mtime is restored as easily as
bytes are changed): a tar whose bytes changed, or that is gone, is refused by name (exit 1), never re-indexed
silently; a moved version with the same bytes is recorded. Labels are places among the sorted classes, so new
tars bringing a class the index does not have are refused (index into a new ``--out``). A rerun with other
labelling or split options is refused. Each run writes the new row indexes, then a new source index and
columns, then ``dataset.json`` last (atomically), then removes what the old manifest named and the new one does
not. Every folder it writes under ``INDEX`` is made without following links (``shards.atomic.owned_folder``); local
tars resolving outside the source are refused unread (``preprocess.adopt.sources``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from preprocess.adopt.scan import ScannedTar, scan_tar
from preprocess.adopt.sources import same_bytes, source_tars, stage
from preprocess.adopt.splits import SplitRule
from preprocess.pack.merge import index_file_rows, write_columns
from preprocess.pack.parts import column_file_names
from preprocess.pack.sources.members import DEFAULT_MAX_BYTES, SourceFields
from preprocess.pack.sources.tars import Skips
from shards.atomic import atomic_output, owned_folder, sha256_file, write_bytes_atomic
from shards.door.shape import as_int, as_object, as_str
from shards.errors import ChecksumError, InputError, ManifestError
from shards.formats.adopted import IndexedRow, rows_bytes, rows_name
from shards.formats.column_writer import MAX_SAMPLE_FIELDS
from shards.formats.columns import COLUMNS_KEY, FOLDER
from shards.lock import output_lock
from shards.manifest import DATASET_FILE, DatasetManifest, ShardInfo, SplitInfo, load_dataset_manifest
from shards.provenance import SkippedFile, SourceInfo
from shards.transport.listing import Listed
from shards.transport.location import locate

log = logging.getLogger("shardcache.adopt")

STORAGE = "wds"
KIND = "wds-adopted"
ADOPTION = "adoption"  # the manifest's record of every tar as indexed
ADOPTION_VERSION = 2  # 2: row indexes record each row's key and checksum (shards.formats.adopted)
DROPPED = "json_fields_dropped"  # scalar .json fields past MAX_SAMPLE_FIELDS of a sample, all runs together
STATE_DIR = ".adopt"  # each new tar's accepted samples while a run scans (part files), removed at its commit


@dataclass(frozen=True)
class IndexReport:
    """What a run did: the index folder, the base the tars' names are relative to (what ``base_url``/``--source``
    must name when reading), tars indexed now and kept from earlier runs, samples per split, refused samples."""

    out: str
    source_base: str
    indexed: tuple[str, ...]
    kept: int
    samples: Mapping[str, int]
    rejected: int
    classes: int

    def to_dict(self) -> dict[str, Any]:
        return {"out": self.out, "source_base": self.source_base, "tars_indexed": len(self.indexed),
                "tars_kept": self.kept, "samples": dict(self.samples), "rejected": self.rejected,
                "classes": self.classes}


@dataclass
class _Previous:
    """An earlier run's index: its manifest and, per tar, ``(bytes, version, sha256)`` as indexed."""

    manifest: DatasetManifest | None = None
    tars: dict[str, tuple[int, dict[str, Any], str]] = field(default_factory=dict)
    touched: bool = False  # a tar's version moved with its bytes the same: the record changes

    def keys(self, out: Path) -> Iterator[tuple[str, str]]:
        """``(key, tar)`` of every sample the earlier run accepted (duplicates across runs are refused too)."""
        if self.manifest is not None:
            for split in self.manifest.splits:
                for row in _old_rows(out, self.manifest, split):
                    yield row["key"], row["shard"]


def index_tars(source: str, out: str, *, label_member: str | None = None, label_field: str | None = None,
               val_fraction: float = 0.0, seed: int = 0, train_shards: tuple[str, ...] = (),
               val_shards: tuple[str, ...] = (), storage_options: Any = None, quiet: bool = False,
               max_bytes: int = DEFAULT_MAX_BYTES) -> IndexReport:
    """Index the WebDataset tars at ``source`` (a folder, a ``.tar`` path or brace pattern, an ``s3://`` prefix or
    pattern, an ``http(s)://`` pattern) into ``out``; stream them with ``open_dataset(out, split,
    remote=Remote(base_url=<the report's source_base>))``. Reruns index only new tars (see the module).
    ``storage_options``: how ``s3://`` is reached and how slow an ``s3://`` or ``http(s)://`` server may be
    (``shards.transport.s3.S3Options`` or a mapping of its fields); unused for local tars."""
    fields = SourceFields(label_member=label_member, label_field=label_field)
    rule = SplitRule(val_fraction, seed, tuple(train_shards), tuple(val_shards))
    base, tars, outside = source_tars(source, storage_options=storage_options)
    folder = locate(base).local_path()  # a source on this machine: the index is never written inside it
    out_path = Path(out).absolute()
    if folder is not None and (out_path.resolve() == folder.resolve()
                               or folder.resolve() in out_path.resolve().parents):
        raise InputError(f"is inside the source folder {base}: the index is written elsewhere, the source is "
                         "never written", path=str(out))
    options = {"adopted": True, "label_member": label_member, "label_field": label_field, "max_bytes": max_bytes,
               **rule.to_dict()}
    out_path.mkdir(parents=True, exist_ok=True)
    with output_lock(out_path, what="shards index"):
        previous = _load_previous(out_path, options)
        fresh = _check_seen(previous, tars)
        if previous.manifest is not None and not fresh and not previous.touched:  # nothing new: nothing written
            return IndexReport(str(out_path), base, (), len(previous.tars),
                               {name: split.samples for name, split in previous.manifest.splits.items()}, 0,
                               len(previous.manifest.classes))
        first_tar = dict(previous.keys(out_path))
        scanned, skips = [], Skips()
        for rel, reason in outside:
            log.warning("refused %s: %s", rel, reason)
            skips.add(rel, reason)
        state = owned_folder(out_path, STATE_DIR)
        for tar in fresh:
            name = hashlib.sha256(tar.rel.encode()).hexdigest()[:24]
            part = state / f"{name}.jsonl"
            if tar.location.local_path() is not None:
                scanned.append(scan_tar(tar, fields, first_tar, max_bytes, part, skips))
            else:
                copy = state / f"{name}.tar"
                try:
                    scanned.append(scan_tar(tar, fields, first_tar, max_bytes, part, skips,
                                            staged=(copy, *stage(tar, copy))))
                finally:
                    copy.unlink(missing_ok=True)
            if not quiet:
                log.info("indexed %s: %d samples, %d refused, %d .json fields past %d a sample dropped", tar.rel,
                         scanned[-1].count, scanned[-1].refused, scanned[-1].dropped_fields, MAX_SAMPLE_FIELDS)
        manifest = _commit(out_path, base, previous, scanned, skips.listed, rule, options)
        for tar in scanned:  # committed: the parts are spent
            tar.part.unlink(missing_ok=True)
    rejected = sum(s.refused for s in scanned)
    return IndexReport(str(out_path), base, tuple(s.rel for s in scanned), len(previous.tars),
                       {name: split.samples for name, split in manifest.splits.items()}, rejected,
                       len(manifest.classes))


def _load_previous(out: Path, options: Mapping[str, Any]) -> _Previous:
    """The index already in ``out`` (none: a first run). A ``dataset.json`` that is not an adopted index, or one
    made with other options, is refused: nothing a user had is replaced."""
    if not (out / DATASET_FILE).exists():
        return _Previous()
    manifest = load_dataset_manifest(out)
    where = str(out / DATASET_FILE)
    if manifest.storage != STORAGE or manifest.packing.get("adopted") is not True:
        raise InputError("holds a dataset.json that is not an adopted index (shards index); choose another --out",
                         path=where)
    recorded = {name: manifest.packing.get(name) for name in options}
    if recorded != dict(options):
        changed = next(name for name in options if recorded[name] != options[name])
        raise InputError(f"was indexed with {changed}={recorded[changed]!r}, not {options[changed]!r}; rerun with "
                         "the same options or index into another --out", path=where)
    record = as_object(manifest.extra.get(ADOPTION), ADOPTION, where=where)
    if record.get("version") != ADOPTION_VERSION:
        raise InputError(f"was indexed by another version of shards index (record version "
                         f"{record.get('version')!r:.20}, this one writes {ADOPTION_VERSION}: its row indexes hold no "
                         "keys or checksums); index the source into a new --out", path=where)
    tars = as_object(record.get("tars"), f"{ADOPTION}.tars", where=where)
    seen = {}
    for rel, entry in tars.items():
        what = f"{ADOPTION}.tars[{rel!r:.80}]"
        entry = as_object(entry, what, where=where)
        seen[rel] = (as_int(entry.get("bytes"), f"{what}.bytes", where=where), _version(entry, what, where),
                     as_str(entry.get("sha256"), f"{what}.sha256", max_len=128, where=where))
    return _Previous(manifest, seen)


def _version(entry: Mapping[str, Any], what: str, where: str) -> dict[str, Any]:
    """A recorded tar's version: ``mtime_ns`` (a local tar) or ``etag`` and ``last_modified`` (an object)."""
    if "mtime_ns" in entry:
        return {"mtime_ns": as_int(entry["mtime_ns"], f"{what}.mtime_ns", lo=-(1 << 63), hi=(1 << 63) - 1,
                                   where=where)}
    return {name: as_str(entry.get(name), f"{what}.{name}", max_len=256, where=where)
            for name in ("etag", "last_modified")}


def _check_seen(previous: _Previous, tars: list[Listed]) -> list[Listed]:
    """The tars not indexed yet; a tar indexed before must hold the same bytes (size, then sha256: a version can
    be restored after a same-size change), else ``ChecksumError`` naming it; one gone is refused the same way."""
    names = {tar.rel for tar in tars}
    gone = sorted(set(previous.tars) - names)
    if gone:
        raise ChecksumError("is in the index but no longer in the source (the index would name a missing tar)",
                            path=gone[0])
    fresh = []
    for tar in tars:
        if tar.rel not in previous.tars:
            fresh.append(tar)
            continue
        size, version, digest = previous.tars[tar.rel]
        if tar.size != size or not same_bytes(tar, size, digest):
            raise ChecksumError("changed since it was indexed (its bytes differ); refused: index the changed source "
                                "into a new --out", path=tar.where)
        if dict(tar.version) != version:  # touched, same bytes: recorded, so the next run need not hash it again
            previous.tars[tar.rel] = (size, dict(tar.version), digest)
            previous.touched = True
    return fresh


def _old_rows(out: Path, manifest: DatasetManifest, split: str) -> Iterator[dict[str, Any]]:
    """The earlier run's source-index rows of ``split`` (our own file, checked against its recorded sha256)."""
    entry = manifest.extra.get("source_index")
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
        raise ManifestError("has no source_index entry", path=str(out / DATASET_FILE))
    path = out / entry["path"]
    if sha256_file(path) != entry.get("sha256"):
        raise ChecksumError("does not match the sha256 dataset.json records", path=str(path))
    for row in index_file_rows(path, split):
        if row.get("split") == split:
            yield row


def _classes(previous: _Previous, scanned: list[ScannedTar]) -> tuple[str, ...]:
    names = {name for tar in scanned for name in tar.classes}
    if previous.manifest is None:
        return tuple(sorted(names))
    new = sorted(names - set(previous.manifest.classes))
    if new:
        raise InputError(f"new tars bring classes the index does not have ({', '.join(map(repr, new[:5]))}); labels "
                         "are places among the sorted classes, so index the grown source into a new --out",
                         path=next(t.rel for t in scanned if t.classes & set(new)))
    return previous.manifest.classes


def _commit(out: Path, base: str, previous: _Previous, scanned: list[ScannedTar], refused: list[tuple[str, str]],
            rule: SplitRule, options: Mapping[str, Any]) -> DatasetManifest:
    classes = _classes(previous, scanned)
    index_of = {name: i for i, name in enumerate(classes)}
    old = previous.manifest
    shards = {name: list(split.shards) for name, split in (old.splits if old else {}).items()}
    new_tars: dict[str, list[ScannedTar]] = {}
    for tar in scanned:
        if not tar.count:  # nothing to read in it: recorded (a rerun checks it) but in no split
            continue
        split = rule.split_of(tar.rel)
        rows = [IndexedRow(row["start"], row["end"], index_of[row["class"]], row["crc"], row["key"])
                for row in tar.rows()]
        data = rows_bytes(rows)
        owned_folder(out, rows_name(tar.rel).rpartition("/")[0])
        write_bytes_atomic(out / rows_name(tar.rel), data)
        counts = [0] * len(classes)
        for row in rows:
            counts[row.label] += 1
        shards.setdefault(split, []).append(ShardInfo(tar.rel, len(rows), tar.bytes, tar.sha256,
                                                      index=rows_name(tar.rel),
                                                      index_sha256=hashlib.sha256(data).hexdigest(),
                                                      class_counts=tuple(counts)))
        new_tars.setdefault(split, []).append(tar)
    splits = {name: SplitInfo(sum(s.samples for s in infos),
                              tuple(sum(s.class_counts[c] for s in infos) for c in range(len(classes))),
                              tuple(infos)) for name, infos in shards.items() if infos}
    generation = as_int(old.extra[ADOPTION].get("generation"), f"{ADOPTION}.generation",
                        where=str(out / DATASET_FILE)) + 1 if old else 1
    dropped = sum(t.dropped_fields for t in scanned) + (as_int(old.extra[ADOPTION].get(DROPPED, 0), DROPPED,
                                                               where=str(out / DATASET_FILE)) if old else 0)
    index = _write_source_index(out, generation, previous, splits, new_tars, index_of)
    skipped = [*(old.source.skipped if old else ()), *(SkippedFile(path, reason) for path, reason in refused)]
    seen = (old.source.files_seen if old else 0) + sum(t.seen for t in scanned)
    tars = {rel: {"bytes": b, **v, "sha256": d} for rel, (b, v, d) in previous.tars.items()}
    tars.update({t.rel: {"bytes": t.bytes, **t.version, "sha256": t.sha256} for t in scanned})
    manifest = DatasetManifest(storage=STORAGE, classes=classes, splits=splits,
                               source=SourceInfo(KIND, base, seen, tuple(skipped)), packing=dict(options),
                               extra={ADOPTION: {"version": ADOPTION_VERSION, "generation": generation,
                                                 DROPPED: dropped, "tars": tars}})
    old_columns = old.extra.get(COLUMNS_KEY) if old else None
    changed = set(new_tars) | ({name for name in splits if name not in (old.splits if old else {})})
    for name in changed:
        owned_folder(out, f"{FOLDER}/{name}")
    columns = write_columns(out, manifest, lambda split: index_file_rows(out / index["path"], split),
                            splits=changed, previous=old_columns)
    manifest = manifest.replace(extra={**manifest.extra, "source_index": index, COLUMNS_KEY: columns})
    manifest.save(out)
    _remove_superseded(out, old, manifest)
    return manifest


def _new_rows(split: str, tars: list[ScannedTar], index_of: Mapping[str, int]) -> Iterator[dict[str, Any]]:
    """The source-index rows of the new tars of ``split``, read back from their part files one tar at a time."""
    for tar in tars:
        for i, row in enumerate(tar.rows()):
            yield {"key": row["key"], "label": index_of[row["class"]], "split": split, "shard": tar.rel, "row": i,
                   "meta": row["meta"]}


def _write_source_index(out: Path, generation: int, previous: _Previous, splits: Mapping[str, SplitInfo],
                        new_tars: Mapping[str, list[ScannedTar]], index_of: Mapping[str, int]) -> dict[str, Any]:
    """``source-index-<generation>.jsonl``: each split's rows in manifest order (the earlier run's, then the new
    tars'), one JSON line each; a new name per run, so the committed manifest's file is never rewritten."""
    name = f"source-index-{generation:04d}.jsonl"
    digest, entries = hashlib.sha256(), 0
    with atomic_output(out / name) as tmp:
        with open(tmp, "wb") as handle:
            for split in splits:
                old_rows = _old_rows(out, previous.manifest, split) \
                    if previous.manifest is not None and split in previous.manifest.splits else iter(())
                for row in itertools.chain(old_rows, _new_rows(split, new_tars.get(split, []), index_of)):
                    line = (json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
                    handle.write(line)
                    digest.update(line)
                    entries += 1
    return {"path": name, "entries": entries, "sha256": digest.hexdigest()}


def _remove_superseded(out: Path, old: DatasetManifest | None, new: DatasetManifest) -> None:
    """After the commit: the old source index and the column files the old manifest named and the new one does
    not (only names of this layout: nothing that merely looks like ours)."""
    if old is None:
        return
    keep = column_file_names(new.extra.get(COLUMNS_KEY))
    names = column_file_names(old.extra.get(COLUMNS_KEY)) - keep
    old_index = old.extra.get("source_index", {}).get("path") if isinstance(old.extra.get("source_index"), dict) \
        else None
    if isinstance(old_index, str) and old_index.startswith("source-index-") and "/" not in old_index \
            and old_index != new.extra["source_index"]["path"]:
        names.add(old_index)
    for name in names:
        (out / name).unlink(missing_ok=True)


__all__ = ["IndexReport", "index_tars"]
