"""Part manifests: what a (possibly killed, possibly one-of-many) packing task leaves behind, and the merge.

Layout inside ``OUT/``::

    .pack/plan.json              the plan every task computed: digest, classes, source (with the files skipped
                                 at scan time), options, shard names
    .pack/lock*                  the writer locks (``shards.lock``); they stay, even through ``--overwrite``
    .pack/<shard>.json           one part manifest per finished shard: its ShardInfo (with its class counts),
                                 class counts, skipped files and per-sample source index; written after the shard
                                 was renamed
    source-index.jsonl           (at merge) one line per source file: key, path, size, mtime_ns, label, split,
                                 shard and meta (the ``<key>.json`` member: width, height...), or shard null and a
                                 reason for skipped files; lets ``--append`` find what is packed
    dataset.json                 (at merge, last) the manifest; ``packing.plan_sha256`` ties it to the plan

A shard counts as finished only when its part manifest matches the plan digest and the shard file still has the
recorded size and sha256, so a rerun redoes exactly the shards that are missing, partial or damaged.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from shards.atomic import sha256_file, tmp_target, write_json_atomic, write_json_shared, write_text_shared
from shards.errors import ManifestError, OutputExistsError, ShardcacheError
from shards.lock import FolderLock, is_lock_file
from shards.manifest import (DATASET_FILE, DatasetManifest, ShardInfo, SkippedFile, SourceInfo, SplitInfo,
                             load_dataset_manifest)

STATE_DIR = ".pack"
PLAN_FILE = "plan.json"
INDEX_FILE = "source-index.jsonl"
_OWN_FILES = (DATASET_FILE, INDEX_FILE)
_SHARD_FILE = re.compile(r"^[A-Za-z0-9_]+-\d{6}\.(tar|h5)$")
_SHARD_INDEX_FILE = re.compile(r"^[A-Za-z0-9_]+-\d{6}\.tar\.idx$")  # the tar writer's per-sample byte index
_APPEND_INDEX_FILE = re.compile(r"^source-index-\d{4}\.jsonl$")  # written by ``--append``


def part_path(out: Path, shard_name: str) -> Path:
    return out / STATE_DIR / f"{shard_name}.json"


def existing_plan_digest(out: Path) -> str | None:
    """The plan digest of whatever ``out`` holds ("" for something unrecognisable, None for nothing of ours)."""
    plan_file = out / STATE_DIR / PLAN_FILE
    if plan_file.is_file():
        try:
            return str(json.loads(plan_file.read_text(encoding="utf-8"))["plan_sha256"])
        except (ValueError, KeyError, TypeError):
            return ""
    if (out / DATASET_FILE).is_file():
        try:
            return str(load_dataset_manifest(out).packing.get("plan_sha256", ""))
        except ShardcacheError:
            return ""
    return None


def _is_own_file(name: str) -> bool:
    """A file ``pack-shards`` writes at the top of OUT, or a temp file a killed run left of one."""
    name = tmp_target(name) or name
    return bool(_SHARD_FILE.match(name) or _SHARD_INDEX_FILE.match(name) or _APPEND_INDEX_FILE.match(name)
                or name in _OWN_FILES)


def remove_packed_output(out: Path) -> None:
    """What ``--overwrite`` deletes: shardcache's own files only, never anything else a user keeps there.

    The lock files in ``.pack/`` stay: the running job holds them, and a new inode would let a second writer in.
    """
    for entry in out.iterdir():
        if entry.name == STATE_DIR and entry.is_dir():
            for state_file in entry.iterdir():
                if state_file.is_file() and not is_lock_file(state_file.name):
                    state_file.unlink()
        elif entry.is_file() and _is_own_file(entry.name):
            entry.unlink()


def check_output(out: Path, digest: str, overwrite: bool) -> str | None:
    """Refuse a folder holding a different dataset (or foreign files) unless ``overwrite``; writes nothing.

    Returns what ``prepare_output`` must remove first: "foreign", "different", or None.
    """
    if out.exists() and not out.is_dir():
        raise OutputExistsError("is a file, not a folder", path=str(out))
    existing = existing_plan_digest(out)
    if existing is None and out.is_dir() and any(p.name != STATE_DIR for p in out.iterdir()):
        if not overwrite:
            raise OutputExistsError("is not empty and holds no shardcache dataset; pass --overwrite to pack "
                                    "into it anyway", path=str(out))
        return "foreign"
    if existing is not None and existing != digest:
        if not overwrite:
            raise OutputExistsError("already holds a different dataset (other source files or options); "
                                    "pass --overwrite to replace it", path=str(out))
        return "different"
    return None


def prepare_output(out: Path, plan_doc: Mapping[str, Any], overwrite: bool,
                   folder_lock: FolderLock | None = None) -> None:
    """Check the folder (``check_output``), clear it when ``overwrite`` says so, and write the plan.

    Called under the writer locks (``shards.lock.claim_output``); removing old output first takes the folder lock
    exclusively, so output another run is still writing is never deleted under it.
    """
    if check_output(out, plan_doc["plan_sha256"], overwrite) is not None:
        if folder_lock is not None:
            folder_lock.exclusive()
        remove_packed_output(out)
    (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
    plan_file = out / STATE_DIR / PLAN_FILE
    if not plan_file.is_file():
        write_json_shared(plan_file, dict(plan_doc))


def load_part(out: Path, shard_name: str, digest: str, *, check_sha256: bool) -> dict[str, Any] | None:
    """The shard's part manifest if the shard is finished and intact, else None (so it is packed again)."""
    path = part_path(out, shard_name)
    try:
        part = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if part.get("plan_sha256") != digest:
        return None
    info = part.get("shard")
    if info is None:
        return part
    shard_file = out / info["path"]
    try:
        if shard_file.stat().st_size != info["bytes"]:
            return None
    except OSError:
        return None
    if check_sha256 and sha256_file(shard_file) != info["sha256"]:
        return None
    if info.get("index") is not None:
        try:
            if sha256_file(out / info["index"]) != info.get("index_sha256"):
                return None
        except OSError:
            return None
    return part


def write_part(out: Path, shard_name: str, part: Mapping[str, Any]) -> None:
    write_json_atomic(part_path(out, shard_name), dict(part))


def read_plan_doc(out: Path) -> dict[str, Any]:
    path = out / STATE_DIR / PLAN_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"no {STATE_DIR}/{PLAN_FILE}: nothing was packed here", path=str(out)) from None
    except ValueError as exc:
        raise ManifestError(f"unreadable plan ({exc})", path=str(path)) from None


def missing_parts(out: Path, plan_doc: Mapping[str, Any]) -> list[str]:
    digest = plan_doc["plan_sha256"]
    return [s["name"] for s in plan_doc["shards"]
            if load_part(out, s["name"], digest, check_sha256=False) is None]


def _write_index(out: Path, parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    lines = []
    for part in parts:
        for row in part["index"]:
            lines.append(json.dumps(row, sort_keys=True, ensure_ascii=False))
    write_text_shared(out / INDEX_FILE, "\n".join(lines) + "\n" if lines else "")
    return {"path": INDEX_FILE, "entries": len(lines), "sha256": sha256_file(out / INDEX_FILE)}


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
    """Write ``source-index.jsonl`` and then ``dataset.json`` from the part manifests of every planned shard.

    Raises when a part is missing: the manifest only ever describes a complete dataset.
    """
    out = Path(out)
    plan_doc = read_plan_doc(out)
    missing = missing_parts(out, plan_doc)
    if missing:
        raise ShardcacheError(f"{len(missing)} of {len(plan_doc['shards'])} shards are not packed yet "
                              f"(first: {missing[0]}); run the remaining tasks, then merge", path=str(out))
    parts = [load_part(out, s["name"], plan_doc["plan_sha256"], check_sha256=False) for s in plan_doc["shards"]]
    manifest = build_manifest(plan_doc, parts)
    index = _write_index(out, parts)
    manifest = manifest.replace(extra={"source_index": index})
    write_json_shared(out / DATASET_FILE, manifest.to_dict())
    for leftover in out.glob("*.tmp"):
        target = tmp_target(leftover.name) or ""
        if _SHARD_FILE.match(target) or _SHARD_INDEX_FILE.match(target):
            leftover.unlink(missing_ok=True)
    return manifest
