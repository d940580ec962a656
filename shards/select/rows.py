"""What a subset filter looks at: each sample's key, label and metadata, per shard, in shard order.

From the pack-time source index (``source-index.jsonl``, named and checksummed in ``dataset.json``) when its rows
carry their position in the shard (``row``) and cover the shard exactly: one small file read instead of the shards.
Otherwise (an older dataset, a feature folder, object storage) by reading the shard through the caller's reader,
so the same location rules, checks and caches apply. Both are untrusted input: a row's metadata must be a JSON
object of bounded size, a source index that does not match its checksum is refused, and one whose name or
symlink leads outside the dataset folder is refused like such a shard (``local_shard_path``), never read.
Malformed metadata or index lines are input errors (exit 2): they stop a selection before anything runs, as a
malformed manifest does; a checksum mismatch is corruption (exit 1), as for a shard.

A dataset packed with a column index (``shards.formats.columns``) is not read row by row at all: ``SampleColumns``
shows its columns as the same fields (the metadata, ``key``, ``label`` and ``class``) to ``Where.mask``, and
``column_fields`` builds one row's fields from them for a Python callable filter, the slow path.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from shards.door.bounded_read import JSONError, parse_json, read_regular_file
from shards.errors import CorruptDataError, InputError, ManifestError
from shards.door.locations import local_shard_path
from shards.door.jsonlines import json_lines
from shards.manifest import DATASET_FILE
from shards.door.shape import MAX_COUNT
from shards.select.where import column_value

log = logging.getLogger(__name__)

MAX_META_BYTES = 64 << 10  # a sample's JSON metadata is a few hundred bytes; more is not metadata


def sample_fields(key: str, label: int, classes: Sequence[str], meta: Any, where: str) -> dict[str, Any]:
    """The fields a ``where`` filter sees: the metadata, then ``key``, ``label`` and ``class`` (which win)."""
    if isinstance(meta, (bytes, bytearray)):
        if len(meta) > MAX_META_BYTES:
            raise InputError(f"metadata of {len(meta)} bytes (at most {MAX_META_BYTES})", path=where, key=key)
        try:
            meta = parse_json(meta) if meta else {}
        except JSONError as exc:
            raise InputError(f"metadata: {exc}", path=where, key=key) from None
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise InputError("metadata is not a JSON object", path=where, key=key)
    name = classes[label] if 0 <= label < len(classes) else None
    return {**meta, "key": key, "label": label, "class": name}


def source_index_path(folder: str | os.PathLike, manifest: Any) -> Path | None:
    """Where the source index ``dataset.json`` names lies in the local ``folder`` (None when it names none):
    confined like a shard, so a name or symlink leading outside is a ``ManifestError`` before anything is read."""
    entry = manifest.extra.get("source_index") if manifest.kind == "images" else None
    if not isinstance(entry, Mapping) or entry.get("path") is None:
        return None
    return local_shard_path(folder, entry["path"], where=str(Path(folder) / DATASET_FILE), what="source index")


def index_rows(folder: str | None, manifest: Any) -> dict[str, list[dict[str, Any]]] | None:
    """Per shard name, the rows of a local dataset's source index in shard order; None when it cannot tell."""
    path = None if folder is None else source_index_path(folder, manifest)
    if path is None or not path.is_file():
        return None
    entry = manifest.extra["source_index"]
    data = read_regular_file(path, error=ManifestError)  # read once: hashed, then parsed
    if entry.get("sha256") and hashlib.sha256(data).hexdigest() != entry["sha256"]:  # a string: shards.manifest
        raise CorruptDataError("source index does not match the checksum in dataset.json", path=str(path))
    by_shard: dict[str, list[dict[str, Any]]] = {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"source index is not UTF-8 ({exc.reason})", path=str(path)) from None
    for number, row, bad in json_lines(text):
        if bad is not None:
            raise ManifestError(f"source index line {number} is not JSON ({bad})", path=str(path))
        if not isinstance(row, dict) or not row.get("shard") or row.get("skipped"):
            continue
        if "row" not in row:
            return None  # packed before rows recorded their position: read the shards instead
        # ``type() is``: a bool is an int to isinstance, and ``true`` is no position, key or label.
        if type(row["row"]) is not int or type(row.get("key")) is not str or type(row.get("label")) is not int \
                or type(row["shard"]) is not str:
            raise ManifestError(f"source index line {number} has no string key, integer label, integer row and "
                                "string shard", path=str(path))
        if not (0 <= row["row"] <= MAX_COUNT and -MAX_COUNT <= row["label"] <= MAX_COUNT):  # int64 holds them
            raise ManifestError(f"source index line {number}: row {row['row']} or label {row['label']} is out of "
                                "range", path=str(path))
        by_shard.setdefault(row["shard"], []).append(row)
    for rows in by_shard.values():
        rows.sort(key=lambda r: r["row"])
    return by_shard


def shard_fields(shard_info: Any, indexed: Mapping[str, list[dict[str, Any]]] | None,
                 read_all: Callable[[], Iterator[Any]], classes: Sequence[str], where: str) -> list[dict[str, Any]]:
    """Every sample's filter fields for one shard: from the source index when it covers the shard exactly,
    else from ``read_all()`` (samples with ``key``, ``label`` and, for images, ``meta`` bytes)."""
    rows = None if indexed is None else indexed.get(shard_info.path)
    if rows is not None and [r["row"] for r in rows] == list(range(shard_info.samples)):
        return [sample_fields(str(r["key"]), int(r["label"]), classes, r.get("meta"), where) for r in rows]
    return [sample_fields(s.key, int(s.label), classes, getattr(s, "meta", None), where) for s in read_all()]


class SampleColumns:
    """A split's columns (``SplitColumns``) as the fields a filter sees: theirs plus ``class``, the name of each
    row's label in ``classes`` (labels checked to lie in range by the caller), built only when a filter reads it."""

    def __init__(self, columns: Any, classes: Sequence[str]):
        self._columns, self._classes = columns, list(classes)
        self.rows: int = columns.rows
        self.fields: tuple[str, ...] = tuple(f for f in columns.fields if f != "class") + ("class",)
        self.unindexed: tuple[str, ...] = tuple(columns.unindexed)
        self._class: np.ndarray | None = None

    def column(self, name: str) -> np.ndarray:
        if name != "class":
            return self._columns.column(name)
        if self._class is None:
            names = np.asarray([c.encode("utf-8", "surrogatepass") for c in self._classes] or [b""])
            self._class = names[self._columns.column("label")]
        return self._class

    def present(self, name: str) -> np.ndarray | None:
        return None if name == "class" else self._columns.present(name)


def column_fields(columns: SampleColumns, row: int) -> dict[str, Any]:
    """One row's filter fields from the columns, as ``sample_fields`` gives them from the source index (for a
    Python callable filter; fields the columns do not index are absent, so the caller uses this only when none
    are)."""
    fields: dict[str, Any] = {}
    for name in columns.fields:
        present = columns.present(name)
        if present is not None and not present[row]:
            continue
        fields[name] = column_value(columns.column(name), row)
    meta = {k: v for k, v in fields.items() if k not in ("key", "label", "class")}
    return {**meta, "key": fields["key"], "label": fields["label"], "class": fields["class"]}
