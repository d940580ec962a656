"""The merge: the part manifests of every planned shard (``preprocess.pack.parts``) made into one dataset.

``merge_parts`` writes ``source-index.jsonl``, then each split's column index from it (``write_columns``, which
``--append`` and ``adopt-tars`` call too), and ``dataset.json`` last, so the manifest only ever describes a
complete dataset. The merge streams: each part manifest is read once, its rows written to the source index and
dropped, and the columns are built from the written index, so its memory is the manifest's per-shard entries, not
the samples.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from preprocess.pack.parts import INDEX_FILE, load_part, planned_names, read_plan_doc
from shards.atomic import atomic_output, remove_stale_tmp, write_json_shared
from shards.door.bounded_read import parse_json
from shards.errors import CorruptDataError, ShardcacheError
from shards.formats.column_writer import Survey, manifest_order, write_split_columns
from shards.formats.columns import COLUMNS_KEY, FORMAT as COLUMNS_FORMAT, next_column_number
from shards.manifest import DATASET_FILE, DatasetManifest, ShardInfo, SplitInfo
from shards.provenance import SkippedFile, SourceInfo


def _merge_index(out: Path, plan_doc: Mapping[str, Any]
                 ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Survey]]:
    """Read each planned shard's part manifest once, in plan order, writing its source-index rows straight into
    ``source-index.jsonl`` (a temp file, renamed once complete) and keeping the rest of the part: memory holds one
    part's rows at a time, however many samples the dataset has. Returns the parts (without their rows), the
    index's manifest entry and, per split, the survey of its packed rows (pass 1 of its columns, made here while
    the rows are at hand); raises when a part is missing: the manifest only ever describes a complete dataset."""
    digest, parts, missing = hashlib.sha256(), [], []
    surveys: dict[str, Survey] = {}
    entries = 0
    with atomic_output(out / INDEX_FILE) as tmp:
        with open(tmp, "wb") as handle:
            for shard in plan_doc["shards"]:
                part = load_part(out, shard["name"], plan_doc["plan_sha256"], check_sha256=False)
                if part is None:
                    missing.append(shard["name"])
                    continue
                for row in part.pop("index"):
                    if row.get("shard") and not row.get("skipped"):
                        surveys.setdefault(row.get("split"), Survey()).add(row)
                    line = (json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
                    handle.write(line)
                    digest.update(line)
                    entries += 1
                parts.append(part)
            if missing:
                raise ShardcacheError(f"{len(missing)} of {len(plan_doc['shards'])} shards are not packed yet "
                                      f"(first: {missing[0]}); run the remaining tasks, then merge", path=str(out))
    return parts, {"path": INDEX_FILE, "entries": entries, "sha256": digest.hexdigest()}, surveys


def index_file_rows(path: Path, split: str) -> Iterator[dict[str, Any]]:
    """The rows of ``split`` (and maybe a few others: the caller checks) in the source index this merge has just
    written from the parts (under the merge lock), one line at a time: the file is never held whole. Each line is a
    ``json.dumps`` of a row the parts held, so a line without the split's ``"split": ...`` text is not parsed."""
    needle = '"split": ' + json.dumps(split, ensure_ascii=False)
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if needle in line:
                yield parse_json(line)


def write_columns(out: Path, manifest: DatasetManifest, rows: Callable[[str], Iterable[Mapping[str, Any]]],
                  splits: Iterable[str] | None = None, previous: Mapping[str, Any] | None = None,
                  surveys: Mapping[str, Survey] | None = None) -> dict[str, Any]:
    """Write the column index (``shards.formats.columns``) of ``splits`` (default: every split of ``manifest``)
    from the source-index rows ``rows(split)`` yields (at least that split's; called twice per split), and return
    the manifest's ``columns`` entry: the written splits' entries, the other splits' kept from ``previous`` (the
    ``columns`` entry being replaced) where it has them. New files are numbered past those ``previous`` names,
    never overwriting one. ``surveys``: pass 1 per split, already made from the same rows (``Survey``)."""
    old = previous.get("splits") if isinstance(previous, Mapping) else None
    old = old if isinstance(old, Mapping) else {}
    chosen = set(manifest.splits) if splits is None else set(splits)
    entry: dict[str, Any] = {}
    for split, info in manifest.splits.items():
        if split in chosen:
            entry[split] = write_split_columns(out, split, lambda: manifest_order(rows(split), split, info.shards),
                                               info.samples, first=next_column_number(old.get(split)),
                                               survey=(surveys or {}).get(split))
        elif split in old:
            entry[split] = old[split]
    return {"format": COLUMNS_FORMAT, "splits": entry}


def build_manifest(plan_doc: Mapping[str, Any], parts: Sequence[Mapping[str, Any]]) -> DatasetManifest:
    classes = tuple(plan_doc["classes"])
    splits: dict[str, SplitInfo] = {}
    for split in plan_doc["splits"]:
        mine = [p for p in parts if p["split"] == split]
        # A part written before shards recorded their class counts has them only beside its ShardInfo.
        shards = tuple(ShardInfo.from_dict({"class_counts": p["class_counts"], **p["shard"]})
                       for p in mine if p["shard"] is not None)
        counts = [sum(p["class_counts"][i] for p in mine) for i in range(len(classes))]
        if shards:
            splits[split] = SplitInfo(sum(s.samples for s in shards), tuple(counts), shards)
    source = plan_doc["source"]
    # Files refused at scan time (not regular files, dangling links) and files refused while packing.
    refused = [*source.get("skipped", []), *(s for p in parts for s in p["skipped"])]
    skipped = sorted((SkippedFile(s["path"], s["reason"]) for s in refused), key=lambda s: s.path)
    return DatasetManifest(
        storage=plan_doc["storage"],
        classes=classes,
        splits=splits,
        source=SourceInfo(source["kind"], source["root"], int(source["files_seen"]), tuple(skipped)),
        packing={**plan_doc["packing"], "plan_sha256": plan_doc["plan_sha256"]},
    )


def merge_parts(out: str | os.PathLike) -> DatasetManifest:
    """Write ``source-index.jsonl``, then each split's column index from it, and then ``dataset.json`` from the
    part manifests of every planned shard. Memory holds the parts' shard entries and counts, never their rows.

    Raises when a part is missing: the manifest only ever describes a complete dataset.
    """
    out = Path(out)
    plan_doc = read_plan_doc(out)
    parts, index, surveys = _merge_index(out, plan_doc)
    manifest = build_manifest(plan_doc, parts)
    if not any(split.samples for split in manifest.splits.values()):
        skipped = manifest.source.skipped
        first = f" (the first: {skipped[0].path}: {skipped[0].reason})" if skipped else ""
        raise CorruptDataError(f"no sample could be packed: all {manifest.source.files_seen:,} source files were "
                               f"skipped{first}; no dataset.json is written", path=str(out))
    columns = write_columns(out, manifest, lambda split: index_file_rows(out / INDEX_FILE, split), surveys=surveys)
    manifest = manifest.replace(extra={"source_index": index, COLUMNS_KEY: columns})
    write_json_shared(out / DATASET_FILE, manifest.to_dict())
    remove_stale_tmp(out, planned_names(plan_doc))  # what killed writers of this plan left
    return manifest
