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

``--overwrite`` deletes only what this layout names (``recorded_names``: the old ``dataset.json`` and what it lists,
the plan's and the parts' shards, their sidecars), never a file that merely looks like a shard (``shards.owned``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from shards.atomic import (remove_stale_tmp, sha256_file, tmp_target, write_json_atomic, write_json_shared,
                           write_text_shared)
from shards.bounded_read import read_json_file
from shards.errors import ManifestError, OutputExistsError, ShardcacheError
from shards.formats.storage import STORAGES
from shards.formats.tarindex import index_name
from shards.lock import FolderLock
from shards.manifest import (DATASET_FILE, DatasetManifest, ShardInfo, SkippedFile, SourceInfo, SplitInfo,
                             load_dataset_manifest)
from shards.owned import manifest_names, plain_names, refuse_clobber, remove_owned

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
            return str(read_json_file(plan_file)["plan_sha256"])
        except (ValueError, KeyError, TypeError):
            return ""
    if (out / DATASET_FILE).is_file():
        try:
            return str(load_dataset_manifest(out).packing.get("plan_sha256", ""))
        except ShardcacheError:
            return ""
    return None


def is_published_name(name: str) -> bool:
    """Whether an object name in an ``s3://`` prefix is one ``pack-shards`` publishes (``preprocess.staging``); a
    local ``--overwrite`` goes by ``recorded_names`` instead."""
    name = tmp_target(name) or name
    return bool(_SHARD_FILE.match(name) or _SHARD_INDEX_FILE.match(name) or _APPEND_INDEX_FILE.match(name)
                or name in _OWN_FILES)


def _shard_files(names: Iterable[Any]) -> list[Any]:
    """The files the shard writer makes for these shard names: each shard, and its byte index where its storage
    writes one (tar)."""
    indexed = tuple(spec.suffix for spec in STORAGES.values() if spec.indexed)
    names = list(names)
    return names + [index_name(n) for n in names if isinstance(n, str) and n.endswith(indexed)]


def planned_names(plan_doc: Mapping[str, Any]) -> set[str]:
    """The files at the top of OUT that packing this plan writes: shards, their sidecars, the index, the manifest."""
    shards = plan_doc.get("shards")
    names = [s.get("name") for s in shards if isinstance(s, Mapping)] if isinstance(shards, list) else []
    return plain_names([*_shard_files(names), INDEX_FILE, DATASET_FILE])


def recorded_names(out: Path) -> set[str]:
    """The files at the top of OUT that what is there names as its own: the old ``dataset.json`` (itself, its
    shards and sidecars, its source index), the plan in ``.pack/`` and the part manifests beside it (one per shard
    written, ``<shard>.json``: the shards of a run killed before its merge, or of an append killed before its
    commit). Whatever they do not name is not ours."""
    names: list[Any] = []
    state = out / STATE_DIR
    if state.is_dir():
        try:
            names += planned_names(read_json_file(state / PLAN_FILE))
        except (OSError, ValueError, AttributeError):
            pass  # no plan, or an unreadable one: it names nothing
        names += _shard_files(p.name[:-len(".json")] for p in state.glob("*.json") if p.name != PLAN_FILE)
    names += manifest_names(out, DATASET_FILE, load_dataset_manifest, _dataset_names)
    return plain_names(names)


def _dataset_names(manifest: Any) -> list[object]:
    """What a ``dataset.json`` names: its shards and their sidecars, its source index."""
    names: list[object] = [name for split in manifest.splits.values()
                           for s in split.shards for name in (s.path, s.index)]
    index = manifest.extra.get("source_index")
    if isinstance(index, Mapping):
        names.append(index.get("path"))
    return names


def check_output(out: Path, plan_doc: Mapping[str, Any], overwrite: bool) -> str | None:
    """Refuse a folder holding a different dataset (or foreign files) unless ``overwrite``; writes nothing.

    Returns what ``prepare_output`` must remove first: "foreign", "different", or None. Even with ``overwrite``,
    a file this plan would write that the old output does not name is refused (``shards.owned.refuse_clobber``).
    """
    if out.exists() and not out.is_dir():
        raise OutputExistsError("is a file, not a folder", path=str(out))
    existing = existing_plan_digest(out)
    conflict = None
    if existing is None and out.is_dir() and any(p.name != STATE_DIR for p in out.iterdir()):
        if not overwrite:
            raise OutputExistsError("is not empty and holds no shardcache dataset; pass --overwrite to pack "
                                    "into it anyway", path=str(out))
        conflict = "foreign"
    elif existing is not None and existing != plan_doc["plan_sha256"]:
        if not overwrite:
            raise OutputExistsError("already holds a different dataset (other source files or options); "
                                    "pass --overwrite to replace it", path=str(out))
        conflict = "different"
    if conflict is not None:
        refuse_clobber(out, recorded_names(out), planned_names(plan_doc), writer="pack-shards")
    return conflict


def prepare_output(out: Path, plan_doc: Mapping[str, Any], overwrite: bool,
                   folder_lock: FolderLock | None = None) -> None:
    """Check the folder (``check_output``), clear it when ``overwrite`` says so, and write the plan.

    Called under the writer locks (``shards.lock.claim_output``); removing old output first takes the folder lock
    exclusively, so output another run is still writing is never deleted under it. The lock files in ``.pack/``
    stay: the running job holds them, and a new inode would let a second writer in.
    """
    if check_output(out, plan_doc, overwrite) is not None:
        if folder_lock is not None:
            folder_lock.exclusive()
        remove_owned(out, recorded_names(out), STATE_DIR)
    (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
    plan_file = out / STATE_DIR / PLAN_FILE
    if not plan_file.is_file():
        write_json_shared(plan_file, dict(plan_doc))


def load_part(out: Path, shard_name: str, digest: str, *, check_sha256: bool) -> dict[str, Any] | None:
    """The shard's part manifest if the shard is finished and intact, else None (so it is packed again)."""
    path = part_path(out, shard_name)
    try:
        part = read_json_file(path)
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
        return read_json_file(path)
    except FileNotFoundError:
        raise ManifestError(f"no {STATE_DIR}/{PLAN_FILE}: nothing was packed here", path=str(out)) from None
    except ManifestError as exc:
        raise ManifestError(f"unreadable plan ({exc.reason})", path=str(path)) from None


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
    remove_stale_tmp(out, planned_names(plan_doc))  # what killed writers of this plan left
    return manifest
