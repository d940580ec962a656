"""Part manifests: what a (possibly killed, possibly one-of-many) packing task leaves behind.

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
    columns/<split>/c000.npy...  (at merge) the column index (``shards.formats.columns``): each split's keys, labels
                                 and metadata fields as fixed-width arrays, built from the source index
    dataset.json                 (at merge, last) the manifest; ``packing.plan_sha256`` ties it to the plan

A shard counts as finished only when its part manifest matches the plan digest and the shard file still has the
recorded size and sha256, so a rerun redoes exactly the shards that are missing, partial or damaged.

``--overwrite`` deletes only what this layout names (``recorded_names``: the old ``dataset.json`` and what it lists,
the plan's and the parts' shards, their sidecars; ``recorded_column_files``: the column files it lists), never a file
that merely looks like a shard (``shards.jobs.owned``).

The merge of the parts into ``source-index.jsonl``, the column index and ``dataset.json`` is
``preprocess.pack.merge``'s.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from shards.atomic import owned_folder, sha256_file, tmp_target, write_bytes_atomic, write_json_shared
from shards.door.bounded_read import read_json_file
from shards.errors import ManifestError, OutputExistsError, ShardcacheError
from shards.formats.columns import COLUMNS_KEY, column_files
from shards.transport.storage import STORAGES
from shards.formats.tarindex import index_name
from shards.lock import FolderLock
from shards.manifest import DATASET_FILE, ShardInfo, load_dataset_manifest
from shards.provenance import SkippedFile, SourceInfo
from shards.jobs.owned import declares_ours, manifest_names, nested_names, plain_names, refuse_clobber, remove_owned
from shards.door.shape import as_int, as_int_list, as_list, as_object, as_str, field as get
from shards.publish.s3_upload import PublishSpec

log = logging.getLogger("shardcache.pack")

STATE_DIR = ".pack"
PLAN_FILE = "plan.json"
INDEX_FILE = "source-index.jsonl"
_OWN_FILES = (DATASET_FILE, INDEX_FILE)
_SHARD_FILE = re.compile(r"^[A-Za-z0-9_]+-\d{6}\.(tar|h5)\Z")
_SHARD_INDEX_FILE = re.compile(r"^[A-Za-z0-9_]+-\d{6}\.tar\.idx\Z")  # the tar writer's per-sample byte index
_APPEND_INDEX_FILE = re.compile(r"^source-index-\d{4}\.jsonl\Z")  # written by ``--append``
_COLUMN_FILE = re.compile(r"columns/[^/]+/c\d{3,}\.npy")  # the column index (``shards.formats.columns``)


def part_path(out: Path, shard_name: str) -> Path:
    return out / STATE_DIR / f"{shard_name}.json"


def existing_plan_digest(out: Path) -> str | None:
    """The plan digest of whatever ``out`` holds ("" for something unrecognisable, None for nothing of ours). A
    damaged ``dataset.json`` over a plan is unrecognisable too: only ``--overwrite`` repairs it (a rerun would stop
    at it), and one that is not ours at all (no shardcache format) is nothing of ours."""
    manifest: Any = None
    if (out / DATASET_FILE).is_file():
        try:
            manifest = load_dataset_manifest(out)
        except ShardcacheError:
            return "" if declares_ours(out / DATASET_FILE) or (out / STATE_DIR / PLAN_FILE).is_file() else None
    plan_file = out / STATE_DIR / PLAN_FILE
    if plan_file.is_file():
        try:
            return plan_shape(read_json_file(plan_file), str(plan_file))["plan_sha256"]
        except ValueError:  # unreadable or of another shape (a ManifestError is a ValueError)
            return ""
    return None if manifest is None else str(manifest.packing.get("plan_sha256", ""))


def is_published_name(name: str) -> bool:
    """Whether an object name in an ``s3://`` prefix is one ``pack-shards`` publishes (``preprocess.staging``); a
    local ``--overwrite`` goes by ``recorded_names`` instead."""
    name = tmp_target(name) or name
    return bool(_SHARD_FILE.match(name) or _SHARD_INDEX_FILE.match(name) or _APPEND_INDEX_FILE.match(name)
                or _COLUMN_FILE.fullmatch(name) or name in _OWN_FILES)


def shard_files(names: Iterable[Any]) -> list[Any]:
    """The files the shard writer makes for these shard names: each shard, and its byte index where its storage
    writes one (tar)."""
    indexed = tuple(spec.suffix for spec in STORAGES.values() if spec.indexed)
    names = list(names)
    return names + [index_name(n) for n in names if isinstance(n, str) and n.endswith(indexed)]


def planned_names(plan_doc: Mapping[str, Any]) -> set[str]:
    """The files at the top of OUT that packing this plan writes: shards, their sidecars, the index, the manifest."""
    shards = plan_doc.get("shards")
    names = [s.get("name") for s in shards if isinstance(s, Mapping)] if isinstance(shards, list) else []
    return plain_names([*shard_files(names), INDEX_FILE, DATASET_FILE])


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
        names += shard_files(p.name[:-len(".json")] for p in state.glob("*.json") if p.name != PLAN_FILE)
    names += manifest_names(out, DATASET_FILE, load_dataset_manifest, _dataset_names)
    return plain_names(names)


def recorded_column_files(out: Path) -> set[str]:
    """The column files (``columns/<split>/c000.npy``) the old ``dataset.json`` names: ``--overwrite`` removes
    these, and no other file under ``columns/``."""
    return nested_names(manifest_names(out, DATASET_FILE, load_dataset_manifest,
                                       lambda manifest: column_file_names(manifest.extra.get(COLUMNS_KEY))),
                        _COLUMN_FILE)


def _dataset_names(manifest: Any) -> list[object]:
    """What a ``dataset.json`` names: its shards and their sidecars, its source index."""
    names: list[object] = [name for split in manifest.splits.values()
                           for s in split.shards for name in (s.path, s.index)]
    index = manifest.extra.get("source_index")
    if isinstance(index, Mapping):
        names.append(index.get("path"))
    return names


def check_output(out: Path, plan_doc: Mapping[str, Any], overwrite: bool,
                 explain: Callable[[], str] | None = None) -> str | None:
    """Refuse a folder holding a different dataset (or foreign files) unless ``overwrite``; writes nothing.
    ``explain()`` says what differs (``preprocess.pack.source_diff.describe_change``), asked only when refusing.

    Returns what ``prepare_output`` must remove first: "foreign", "different", or None. Even with ``overwrite``,
    a file this plan would write that the old output does not name is refused (``shards.jobs.owned.refuse_clobber``).
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
            why = explain() if explain is not None else "other source files or options; pass --overwrite to replace it"
            raise OutputExistsError(f"already holds a different dataset: {why}", path=str(out))
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
        remove_owned(out, recorded_names(out), STATE_DIR, nested=recorded_column_files(out))
    owned_folder(out, STATE_DIR)
    plan_file = out / STATE_DIR / PLAN_FILE
    if not plan_file.is_file():
        write_json_shared(plan_file, dict(plan_doc))


def plan_shape(value: Any, where: str) -> dict[str, Any]:
    """``value`` if it is a plan as ``pack-shards`` writes it (``.pack/plan.json``), each field of its type; its
    shard names must be ones the packer makes (a name is a file in ``OUT`` and in ``OUT/.pack``), else a
    ``ManifestError`` naming the field."""
    plan = as_object(value, "the plan", where=where)
    for name in ("plan_sha256", "storage"):
        as_str(get(plan, name, "", where=where), name, max_len=128, where=where)
    for name in ("classes", "splits"):
        for index, item in enumerate(as_list(get(plan, name, "", where=where), name, where=where)):
            as_str(item, f"{name}[{index}]", where=where)
    for index, shard in enumerate(as_list(get(plan, "shards", "", where=where), "shards", where=where)):
        what = f"shards[{index}]"
        name = as_str(get(as_object(shard, what, where=where), "name", what, where=where), f"{what}.name",
                      where=where)
        as_str(get(shard, "split", what, where=where), f"{what}.split", where=where)
        if not _SHARD_FILE.match(name):
            raise ManifestError(f"{what}.name {name!r:.80} is not a shard name pack-shards writes", path=where)
    SourceInfo.from_dict(get(plan, "source", "", where=where), where)
    as_object(get(plan, "packing", "", where=where), "packing", where=where)
    return plan


def part_shape(value: Any, shard_name: str, where: str) -> dict[str, Any]:
    """``value`` if it is the part manifest of shard ``shard_name`` as ``pack_shard`` writes it, each field of
    its type and the shard entry a valid ``ShardInfo`` of that very name; else a ``ManifestError`` naming the
    field."""
    part = as_object(value, "the part", where=where)
    as_str(get(part, "plan_sha256", "", where=where), "plan_sha256", max_len=128, where=where)
    as_str(get(part, "split", "", where=where), "split", where=where)
    counts = as_int_list(get(part, "class_counts", "", where=where), "class_counts", where=where)
    for index, item in enumerate(as_list(get(part, "skipped", "", where=where), "skipped", where=where)):
        SkippedFile.from_dict(item, where, f"skipped[{index}]")
    for index, row in enumerate(as_list(get(part, "index", "", default=[], where=where), "index", where=where)):
        as_object(row, f"index[{index}]", where=where)
    for name in ("source_files", "source_bytes"):
        as_int(get(part, name, "", default=0, where=where), name, where=where)
    shard = part.get("shard")
    if shard is not None:
        info = ShardInfo.from_dict({"class_counts": counts, **as_object(shard, "shard", where=where)}, where)
        if info.path != shard_name:
            raise ManifestError(f"shard.path is {info.path!r:.80}, not {shard_name!r}", path=where)
    return part


def load_part(out: Path, shard_name: str, digest: str, *, check_sha256: bool) -> dict[str, Any] | None:
    """The shard's part manifest if the shard is finished and intact, else None (so it is packed again). A part
    of another shape (``part_shape``) is not trusted to describe anything: its shard is packed again too."""
    path = part_path(out, shard_name)
    try:
        part = part_shape(read_json_file(path), shard_name, str(path))
    except ManifestError as exc:
        log.warning("%s; packing %s again", exc, shard_name)
        return None
    except (OSError, ValueError):  # not written yet (or unreadable): packed again
        return None
    if part["plan_sha256"] != digest:
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
    """Compact JSON: indenting takes the pure-Python encoder, a tenth of a worker's time per file."""
    text = json.dumps(dict(part), sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n"
    write_bytes_atomic(part_path(out, shard_name), text.encode("utf-8"))


def read_plan_doc(out: Path) -> dict[str, Any]:
    path = out / STATE_DIR / PLAN_FILE
    try:
        return plan_shape(read_json_file(path), str(path))
    except FileNotFoundError:
        raise ManifestError(f"no {STATE_DIR}/{PLAN_FILE}: nothing was packed here", path=str(out)) from None
    except ManifestError as exc:
        raise ManifestError(f"unreadable plan ({exc.reason})", path=str(path)) from None


def missing_parts(out: Path, plan_doc: Mapping[str, Any]) -> list[str]:
    digest = plan_doc["plan_sha256"]
    return [s["name"] for s in plan_doc["shards"]
            if load_part(out, s["name"], digest, check_sha256=False) is None]


def column_file_names(entry: Any) -> set[str]:
    """The column files (``columns/<split>/c000.npy``) a manifest's ``columns`` entry names, each a well-formed
    relative path of this layout: what ``--overwrite`` and an append's cleanup may remove, and nothing else."""
    return nested_names(column_files(entry), _COLUMN_FILE)


def dataset_spec() -> PublishSpec:
    """What ``pack-shards --out s3://`` publishes (``preprocess.staging``): ``dataset.json`` last, the objects it may
    replace, and the plan that tells a rerun of the same job from another job."""
    return PublishSpec(DATASET_FILE, lambda manifest: manifest.get("packing", {}).get("plan_sha256"),
                       is_published_name)
