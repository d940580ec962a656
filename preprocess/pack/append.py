"""``pack-shards --append``: pack what is new in the source into new shards, never rewriting a packed one.

A packed file is known by its source-relative path with size and mtime, from the source index that packing
writes (``source-index*.jsonl``, named in ``dataset.json``). New files go into new shards with the next indices of
their split, packed like the first time: the packing options recorded in ``dataset.json`` apply, not the ones given
now. Files that changed or disappeared since are reported and keep their packed version; ``prune`` instead writes a
new version without them: every shard holding one is copied, minus those samples, into a new shard, and changed
files are packed again as new ones. The new ``dataset.json`` (naming a new index file) is the commit: a run killed
before it leaves the old dataset whole, and a rerun redoes the same work under the same names. An append holds
the folder's writer lock exclusively (``shards.lock``), so a concurrent append or pack exits with code 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from preprocess.pack.sources.members import MemberSpec, SourceFields
from preprocess.pack.packer import PackConfig, ShardJob, PackMeter, run_jobs, check_strict, log_skipped, pack
from preprocess.pack.merge import write_columns
from preprocess.pack.parts import PLAN_FILE, STATE_DIR, column_file_names
from preprocess.pack.plan import PlannedShard, assign_splits, cut_shards, split_order_key
from preprocess.pack.sources.columns import SourceSample
from preprocess.pack.sources.scan import SourceScan, scan_source
from preprocess.pack.source_diff import SourceDiff, diff_source, read_index
from shards.atomic import sha256_file, write_bytes_atomic
from shards.door.bounded_read import read_json_file
from shards.errors import InputError
from shards.manifest import DATASET_FILE, DatasetManifest, ShardInfo, SplitInfo, load_dataset_manifest, utc_now
from shards.provenance import SkippedFile, SourceInfo
from shards.formats.columns import COLUMNS_KEY
from shards.transport.storage import get_storage, shard_name
from shards.formats.tarindex import index_name
from shards.lock import claim_output
from shards.jobs.owned import remove_nested

log = logging.getLogger("shardcache.append")
_SHARD_INDEX = re.compile(r"-(\d{6})\.[a-z0-9]+\Z")


@dataclass(frozen=True)
class AppendResult:
    manifest: DatasetManifest
    summary: dict[str, Any]


def recorded_config(cfg: PackConfig, manifest: DatasetManifest) -> PackConfig:
    """``cfg`` with the packing options the dataset was made with, so appended shards are made the same way."""
    packing = manifest.packing
    reencode = packing.get("reencode") or {}
    return dataclasses.replace(
        cfg, storage=manifest.storage, max_samples=int(packing["max_samples"]), max_bytes=int(packing["max_bytes"]),
        val_fraction=float(packing["val_fraction"]), seed=int(packing["seed"]), shuffle=bool(packing["shuffle"]),
        verify=str(packing["verify"]), max_pixels=int(packing["max_pixels"]),
        resize_max_side=reencode.get("max_side"), quality=reencode.get("quality"),
        source_fields=SourceFields(**packing["source_fields"]) if "source_fields" in packing else cfg.source_fields)


def relabel(scan: SourceScan, manifest: DatasetManifest) -> list[SourceSample]:
    """The scanned samples with labels in the dataset's class list; a new class cannot be appended."""
    if scan.kind != manifest.source.kind:
        raise InputError(f"the source is now {scan.kind!r} but was packed as {manifest.source.kind!r}",
                         path=scan.root)
    unknown = sorted(set(scan.classes) - set(manifest.classes))
    if unknown:
        raise InputError(f"new class {unknown[0]!r}: appending cannot add classes (the labels of packed shards "
                         "would change); repack with --overwrite", path=scan.root)
    to_label = manifest.class_to_idx
    return [s._replace(label=to_label[scan.classes[s.label]]) for s in scan.samples]


def _next_indices(out: Path, manifest: DatasetManifest) -> dict[str, int]:
    """Per split, one past the highest shard index ever used (the manifest's shards and the first pack's plan,
    whose all-skipped shards have no file), so a new shard never reuses a name."""
    names = [(split, s.path) for split, info in manifest.splits.items() for s in info.shards]
    plan_file = out / STATE_DIR / PLAN_FILE
    if plan_file.is_file():
        names += [(s["split"], s["name"]) for s in read_json_file(plan_file)["shards"]]
    nxt: dict[str, int] = {}
    for split, name in names:
        match = _SHARD_INDEX.search(name)
        if match:
            nxt[split] = max(nxt.get(split, 0), int(match.group(1)) + 1)
    return nxt


def plan_new_shards(samples: Sequence[SourceSample], cfg: PackConfig, manifest: DatasetManifest, scan_kind: str,
                    next_index: dict[str, int], batch: int) -> list[PlannedShard]:
    """Split (stratified within the batch, as packing does), shuffle (seeded by the batch) and cut into shards."""
    if not samples:
        return []
    scan = SourceScan(scan_kind, manifest.source.root, manifest.classes, tuple(samples))
    planned: list[PlannedShard] = []
    for split, members in assign_splits(scan, cfg.val_fraction, cfg.seed).items():
        ordered = sorted(members, key=lambda s: s.rel_path)
        if cfg.shuffle:
            random.Random(f"{cfg.seed}/append/{batch}/{split}").shuffle(ordered)
        start = next_index.get(split, 0)
        for i, shard in enumerate(cut_shards(ordered, split, cfg.storage, cfg.max_samples, cfg.max_bytes)):
            planned.append(PlannedShard(shard_name(split, start + i, cfg.storage), split, shard.samples))
        next_index[split] = start + i + 1
    return planned


def rewrite_without(out: Path, manifest: DatasetManifest, index: dict[str, dict[str, Any]], drop: set[str],
                    next_index: dict[str, int]) -> dict[str, ShardInfo | None]:
    """Copy every shard holding a dropped file, minus those samples, into a new shard: old path -> new info."""
    storage = get_storage(manifest.storage)
    split_of = {s.path: name for name, info in manifest.splits.items() for s in info.shards}
    rows_of: dict[str, list[dict[str, Any]]] = {}
    for row in index.values():
        if row.get("shard"):
            rows_of.setdefault(row["shard"], []).append(row)
    holders = sorted({index[p]["shard"] for p in drop if index[p].get("shard")}, key=_by_split_then_name)
    replaced: dict[str, ShardInfo | None] = {}
    for old in holders:
        split = split_of[old]
        drop_keys = {index[p]["key"] for p in drop if index[p].get("shard") == old}
        kept_rows = [row for row in rows_of[old] if row["key"] not in drop_keys]
        if not kept_rows:
            replaced[old] = None
            continue
        name = shard_name(split, next_index.get(split, 0), manifest.storage)
        next_index[split] = next_index.get(split, 0) + 1
        counts = [0] * len(manifest.classes)
        positions: dict[str, int] = {}
        with storage.writer(out / name, classes=manifest.classes) as writer:
            for raw in storage.read(out / old):
                if raw.key not in drop_keys:
                    positions[raw.key] = writer.samples
                    writer.write(raw)
                    counts[raw.label] += 1
        replaced[old] = ShardInfo(name, writer.samples, writer.bytes, writer.sha256,
                                  index=getattr(writer, "index", None),
                                  index_sha256=getattr(writer, "index_sha256", None), class_counts=tuple(counts))
        for row in kept_rows:
            row["shard"] = name
            row.pop("row", None)
            if row["key"] in positions:  # its new position (``shards.select.rows`` selects rows by it)
                row["row"] = positions[row["key"]]
    return replaced


def _by_split_then_name(path: str) -> tuple[tuple[int, str], str]:
    return split_order_key(path.rsplit("-", 1)[0]), path


def _write_index(out: Path, rows: Iterable[Mapping[str, Any]], batch: int) -> dict[str, Any]:
    name = f"source-index-{batch:04d}.jsonl"
    lines = [json.dumps(dict(row), sort_keys=True, ensure_ascii=False) for row in sorted(rows, key=lambda r: r["path"])]
    write_bytes_atomic(out / name, ("\n".join(lines) + "\n" if lines else "").encode("utf-8"))
    return {"path": name, "entries": len(lines), "sha256": sha256_file(out / name)}


def build_manifest(manifest: DatasetManifest, rows: Sequence[Mapping[str, Any]], replaced: Mapping[str, Any],
                   new_infos: Sequence[tuple[str, ShardInfo]], files_seen: int,
                   append_record: Mapping[str, Any], scan_skipped: Sequence[SkippedFile] = ()) -> DatasetManifest:
    """The next version: old shards (or their replacements) then new ones; counts recomputed from the index."""
    shards: dict[str, list[ShardInfo]] = {}
    for split, info in manifest.splits.items():
        kept = [replaced.get(s.path, s) for s in info.shards]
        shards[split] = [s for s in kept if s is not None]
    for split, info in new_infos:
        shards.setdefault(split, []).append(info)
    counts: dict[str, Counter] = {split: Counter() for split in shards}
    for row in rows:
        if row.get("shard"):
            counts.setdefault(row["split"], Counter())[row["label"]] += 1
    splits = {}
    for split in sorted(shards, key=split_order_key):
        if shards[split]:
            class_counts = tuple(counts[split][i] for i in range(len(manifest.classes)))
            splits[split] = SplitInfo(sum(s.samples for s in shards[split]), class_counts, tuple(shards[split]))
    skipped = [SkippedFile(r["path"], r["skipped"]) for r in rows if r.get("skipped")]
    skipped = tuple(sorted([*skipped, *scan_skipped], key=lambda s: s.path))
    source = SourceInfo(manifest.source.kind, manifest.source.root, files_seen, skipped)
    packing = {**manifest.packing, "appends": [*manifest.packing.get("appends", []), dict(append_record)]}
    return manifest.replace(splits=splits, source=source, packing=packing, created=utc_now())


def _report(diff: SourceDiff, prune: bool) -> None:
    for what, paths in (("changed", [s.rel_path for s in diff.changed]), ("disappeared", list(diff.disappeared))):
        if paths:
            action = "dropping them (--prune)" if prune else "their packed version stays; --prune drops them"
            log.warning("%d source file(s) %s since packing (first: %s); %s", len(paths), what, paths[0], action)


def append(cfg: PackConfig, *, prune: bool = False) -> AppendResult:
    """Pack the source's new files into new shards of ``cfg.out`` (everything, when nothing is packed yet)."""
    started = time.monotonic()
    out = Path(cfg.out)
    if not (out / DATASET_FILE).is_file():
        result = pack(cfg)
        if result.manifest is None:
            raise InputError("--append found no dataset.json and packed only this task's share; run all tasks, "
                             "then append", path=str(out))
        return AppendResult(result.manifest, {**result.summary, "new_files": result.summary["files_seen"]})
    if cfg.num_tasks != 1:
        raise InputError("--append runs as one task; drop --task-index/--num-tasks", path=str(out))
    with claim_output(out, STATE_DIR, what="pack-shards --append", exclusive=True):
        return _append_claimed(cfg, out, prune, started)


def _append_claimed(cfg: PackConfig, out: Path, prune: bool, started: float) -> AppendResult:
    manifest = load_dataset_manifest(out)
    index = read_index(out, manifest)
    cfg = recorded_config(cfg, manifest)
    scan = scan_source(cfg.source, allow_empty_classes=cfg.allow_empty_classes, fields=cfg.source_fields,
                       max_bytes=cfg.max_bytes)
    check_strict(scan, cfg.strict)
    diff, taken = _refuse_taken_keys(scan, diff_source(relabel(scan, manifest), index), index)
    _report(diff, prune)
    drop = set(diff.disappeared) | {s.rel_path for s in diff.changed} if prune else set()
    to_pack = list(diff.new) + (list(diff.changed) if prune else [])
    if not to_pack and not drop:
        log.info("%s: nothing new in %s (%d files packed already)", out, cfg.source, diff.unchanged)
        if COLUMNS_KEY not in manifest.extra:  # packed before the column index: it gets one now
            manifest = manifest.replace(extra={**manifest.extra,
                                               COLUMNS_KEY: _columns(out, manifest, manifest, index.values())})
            manifest.save(out)
        return AppendResult(manifest, _summary(cfg, manifest, diff, [], {}, started, drop))
    batch = len(manifest.packing.get("appends", [])) + 1
    next_index = _next_indices(out, manifest)
    replaced = rewrite_without(out, manifest, index, drop, next_index)
    planned = plan_new_shards(to_pack, cfg, manifest, scan.kind, next_index, batch)
    parts = _pack_planned(out, planned, manifest.classes, cfg, batch, scan.members)
    rows = [row for path, row in index.items() if path not in drop] + [row for p in parts for row in p["index"]]
    new_infos = sorted(((p["split"], ShardInfo.from_dict(p["shard"])) for p in parts if p["shard"] is not None),
                       key=lambda item: _by_split_then_name(item[1].path))
    record = {"created": utc_now(), "new_files": len(diff.new), "dropped_files": len(drop),
              "shards": [info.path for _, info in new_infos],
              "replaced": {old: (new.path if new else None) for old, new in replaced.items()}}
    scan_skipped = [SkippedFile(s.rel_path, s.reason) for s in scan.skipped] + taken
    updated = build_manifest(manifest, rows, replaced, new_infos, scan.files_seen, record, scan_skipped)
    updated = updated.replace(extra={**manifest.extra, "source_index": _write_index(out, rows, batch)})
    updated = updated.replace(extra={**updated.extra, COLUMNS_KEY: _columns(out, manifest, updated, rows)})
    updated.save(out)
    log_skipped([(s.path, s.reason) for s in scan_skipped]
                + [(s["path"], s["reason"]) for part in parts for s in part["skipped"]],
                len(to_pack) + len(scan_skipped))
    _remove_superseded(out, manifest, replaced, updated)
    return AppendResult(updated, _summary(cfg, updated, diff, [i.path for _, i in new_infos], replaced, started, drop))


def _refuse_taken_keys(scan: SourceScan, diff: SourceDiff, index: Mapping[str, Mapping[str, Any]]
                       ) -> tuple[SourceDiff, list[SkippedFile]]:
    """A source that keeps its own keys (WebDataset tars) could bring a new sample under a key the dataset already
    holds (the same tar under another name): such a sample is skipped, never packed twice under one key."""
    if not scan.samples.kept_keys:
        return diff, []
    packed = {row["key"]: path for path, row in index.items() if row.get("shard")}
    taken = [SkippedFile(s.rel_path, f"duplicate key (already packed from {packed[s.key]})")
             for s in diff.new if s.key in packed]
    if taken:
        log.warning("%d new sample(s) have keys the dataset already holds (first: %s); skipped", len(taken),
                    taken[0].path)
    return dataclasses.replace(diff, new=tuple(s for s in diff.new if s.key not in packed)), taken


def _pack_planned(out: Path, planned: Sequence[PlannedShard], classes: tuple[str, ...], cfg: PackConfig,
                  batch: int, members: MemberSpec | None = None) -> list[dict[str, Any]]:
    """Pack the new shards with the packer's own shard job, in ``cfg.workers`` processes (``members``: how to read
    the samples of a container source)."""
    digest = hashlib.sha256(json.dumps([batch, [s.name for s in planned]]).encode()).hexdigest()
    jobs = [ShardJob(str(out), s, classes, cfg.storage, cfg.validate, cfg.strict, digest, members=members)
            for s in planned]
    meter = PackMeter(sum(len(s.samples) for s in planned), cfg.quiet)
    try:
        parts = run_jobs(jobs, cfg.workers, meter)
    finally:
        meter.bar.close()
    return parts


def _columns(out: Path, previous: DatasetManifest, updated: DatasetManifest,
             rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The column index of ``updated``: the splits whose shards changed (or that had none) written again from
    ``rows`` (the whole new source index, held in memory by the append anyway) in manifest order, numbered past
    the files the committed manifest names (which stay until the commit); the other splits' entries kept.

    A split whose rows do not all record their shard position (packed before rows did) gets no columns: its
    readers use the source index as before."""
    old = previous.extra.get(COLUMNS_KEY) if isinstance(previous.extra.get(COLUMNS_KEY), Mapping) else {}
    old_splits = old.get("splits") if isinstance(old.get("splits"), Mapping) else {}
    changed = [split for split, info in updated.splits.items()
               if split not in old_splits or split not in previous.splits or previous.splits[split] != info]
    position = {s.path: i for info in updated.splits.values() for i, s in enumerate(info.shards)}
    packed = [row for row in rows if row.get("shard") in position and not row.get("skipped")]
    unordered = {row["split"] for row in packed if type(row.get("row")) is not int}
    for split in sorted(unordered & set(changed)):
        log.info("%s: split %r was packed before source-index rows recorded their position; it gets no column "
                 "index (repack to add one)", out, split)
    packed.sort(key=lambda row: (position[row["shard"]], row["row"] if type(row.get("row")) is int else -1))
    return write_columns(out, updated, lambda split: packed, [s for s in changed if s not in unordered], old)


def _remove_superseded(out: Path, previous: DatasetManifest, replaced: Mapping[str, Any],
                       updated: DatasetManifest) -> None:
    """After the commit: the old index file, the column files the new manifest no longer names and the shards
    that pruning replaced are no longer referenced."""
    old_index = previous.extra.get("source_index", {}).get("path")
    if old_index:
        (out / old_index).unlink(missing_ok=True)
    remove_nested(out, column_file_names(previous.extra.get(COLUMNS_KEY))
                  - column_file_names(updated.extra.get(COLUMNS_KEY)))
    for old in replaced:
        (out / old).unlink(missing_ok=True)
        (out / index_name(old)).unlink(missing_ok=True)


def _summary(cfg: PackConfig, manifest: DatasetManifest, diff: SourceDiff, written: list[str],
             replaced: Mapping[str, Any], started: float, drop: set[str]) -> dict[str, Any]:
    shards = [s for split in manifest.splits.values() for s in split.shards]
    return {"out": str(cfg.out), "complete": True, "append": True, "new_files": len(diff.new),
            "changed_files": len(diff.changed), "disappeared_files": len(diff.disappeared),
            "dropped_files": len(drop), "shards_written": len(written), "new_shards": written,
            "replaced_shards": {old: (new.path if new else None) for old, new in replaced.items()},
            "samples": sum(s.samples for s in shards), "shards": len(shards), "bytes": sum(s.bytes for s in shards),
            "skipped": len(manifest.source.skipped), "files_seen": diff.unchanged + len(diff.new) + len(diff.changed),
            "splits": {name: split.samples for name, split in manifest.splits.items()},
            "seconds": round(time.monotonic() - started, 3)}


def append_shards(cfg: PackConfig, *, prune: bool = False) -> DatasetManifest:
    """The library entry point of ``pack-shards --append``: returns the new (or unchanged) manifest."""
    return append(cfg, prune=prune).manifest
