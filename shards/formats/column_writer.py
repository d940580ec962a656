"""Writing the column index (``shards.formats.columns`` holds the format and reading): at pack time, from rows.

Writing streams: ``write_split_columns`` reads the rows twice (types and widths, then values) and writes chunks
of ``CHUNK_ROWS`` rows, so memory does not grow with the number of samples; every file goes to a temp name, is
fsynced, and all of a split's files are renamed only once all are complete. ``manifest_order`` checks that the
source index's rows come in column order before they are written.

Metadata comes from samples' ``.json`` members, which anyone writing a source controls: each distinct field costs
a file or two, so a split indexes at most ``MAX_FIELDS`` distinct fields (the first met) and at most
``MAX_SAMPLE_FIELDS`` of any one sample (its first); the rest are dropped and counted in the split's entry
(``dropped``: fields and values, a few names), never each listed.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from shards.atomic import fsync_dir, owned_folder, remove_stale_tmp, unique_tmp_path
from shards.errors import ManifestError, ShardcacheError
from shards.formats.columns import FOLDER

CHUNK_ROWS = 1 << 13  # rows held at once while writing: a few MB of row objects
INT64 = (-(1 << 63), (1 << 63) - 1)
FLOAT_EXACT = 1 << 53  # ints beyond this lose digits in a float64 column, so mixed with floats they get none
_RESERVED = ("key", "label", "class")  # the sample's own key and label win; class is classes[label]
_KIND = {bool: "bool", int: "int", float: "float", str: "str"}
MAX_FIELDS = 64  # distinct metadata fields a split indexes
MAX_SAMPLE_FIELDS = 32  # metadata fields one sample contributes
_DROPPED_NAMES = 8  # dropped fields named in the entry
_COUNTED_DROPS = 10_000  # distinct dropped fields counted; past it, only their values are


def _dtype_of(kinds: set[str], width: int) -> np.dtype | None:
    """A field's column dtype from the kinds of value it holds; None: it gets no column (``unindexed``)."""
    if kinds == {"bool"}:
        return np.dtype(bool)
    if kinds and kinds <= {"int", "bigint"}:
        return np.dtype("<i8")
    if kinds and kinds <= {"int", "float"}:  # a float64 holds every int up to 2**53 exactly; "bigint" is beyond
        return np.dtype("<f8")
    if kinds == {"str"}:
        return np.dtype(f"S{max(width, 1)}")
    return None


def _utf8_width(text: str) -> int | None:
    """The bytes ``text`` takes in an ``S`` column, or None when a column cannot hold it as it is: NumPy drops
    trailing NULs (so any NUL is refused) and a lone surrogate has no UTF-8 form."""
    if text.isascii():
        return None if "\x00" in text else len(text)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return None if b"\x00" in data else len(data)


@dataclass
class _Field:
    kinds: set[str] = field(default_factory=set)
    width: int = 0
    count: int = 0


class Survey:
    """Pass 1 of writing a split's columns: the row count, the keys' byte width, and each metadata field's kinds,
    width and count. ``write_split_columns`` makes one from the rows, or is handed one a caller filled while it
    held the rows anyway (the merge, as it writes the source index), saving a read of the index."""

    def __init__(self) -> None:
        self.count, self.key_width, self._fields = 0, 1, {}
        self.dropped_values = 0  # values of fields past the caps
        self.dropped_fields: set[str] = set()  # counted up to _COUNTED_DROPS names (memory stays bounded)

    def add(self, row: Mapping[str, Any]) -> None:
        key, label, fields = row.get("key"), row.get("label"), self._fields
        if type(key) is not str or type(label) is not int or not 0 <= label < (1 << 31):
            raise ManifestError(f"source-index row {self.count} has no string key and int32 label: "
                                f"key {key!r:.80}, label {label!r:.40}")
        width = _utf8_width(key)
        if width is None:
            raise ManifestError(f"source-index row {self.count}: key {key!r:.80} holds a NUL or is not UTF-8")
        self.key_width = max(self.key_width, width)
        meta = row.get("meta") or {}
        if not isinstance(meta, dict):
            raise ManifestError(f"source-index row {self.count} (sample {key!r:.80}): meta is not an object")
        self.dropped_values += max(0, len(meta) - MAX_SAMPLE_FIELDS)
        for name, value in capped_meta(meta).items():
            info = fields.get(name)
            if info is None and (len(fields) >= MAX_FIELDS or name in self.dropped_fields):
                self._drop(name)
                continue
            if info is None:
                info = fields[name] = _Field()
            kind = _KIND.get(type(value), "other")
            if kind == "str":
                width = _utf8_width(value)
                if width is None:
                    kind = "other"
                else:
                    info.width = max(info.width, width)
            elif kind == "int" and not -FLOAT_EXACT <= value <= FLOAT_EXACT:
                kind = "bigint" if INT64[0] <= value <= INT64[1] else "other"
            info.kinds.add(kind)
            info.count += 1
        self.count += 1

    def _drop(self, name: str) -> None:
        self.dropped_values += 1
        if len(self.dropped_fields) < _COUNTED_DROPS:
            self.dropped_fields.add(name)

    def dropped(self) -> dict[str, Any] | None:
        """The split entry's record of what the caps dropped, None when nothing was."""
        if not self.dropped_values:
            return None
        return {"fields": len(self.dropped_fields), "values": self.dropped_values,
                "names": sorted(self.dropped_fields)[:_DROPPED_NAMES]}

    @property
    def fields(self) -> dict[str, _Field]:
        """The metadata fields that may get a column: the sample's own key and label win, class is derived."""
        return {name: info for name, info in self._fields.items() if name not in _RESERVED}


def capped_meta(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    """A sample's first ``MAX_SAMPLE_FIELDS`` metadata fields: what the survey counts and the columns hold."""
    if len(meta) <= MAX_SAMPLE_FIELDS:
        return meta
    return dict(itertools.islice(meta.items(), MAX_SAMPLE_FIELDS))


Values = Callable[[list, list], list]  # (a chunk of rows, their meta objects) -> the column's values


@dataclass
class _Column:
    """One file being written: how its values come from a chunk of rows, its temp path and running sha256."""

    dtype: np.dtype
    values: Values
    final: Path
    tmp: Path
    digest: Any = field(default_factory=hashlib.sha256)
    size: int = 0

    def start(self, rows: int) -> None:
        with open(self.tmp, "wb") as handle:
            np.lib.format.write_array_header_1_0(
                handle, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                         "shape": (rows,)})
        header = self.tmp.read_bytes()
        self.digest.update(header)
        self.size = len(header)

    def write(self, rows: list, metas: list) -> None:
        data = np.asarray(self.values(rows, metas), dtype=self.dtype).tobytes()
        with open(self.tmp, "ab") as handle:
            handle.write(data)
        self.digest.update(data)
        self.size += len(data)

    def finish(self) -> dict[str, Any]:
        with open(self.tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        return {"sha256": self.digest.hexdigest(), "bytes": self.size}


def _keys(rows: list, metas: list) -> list:
    return [row["key"].encode("utf-8") for row in rows]


def _labels(rows: list, metas: list) -> list:
    return [row["label"] for row in rows]


def _field(name: str, text: bool) -> Values:
    """A metadata field's values; a row without it holds 0 / False / b"" (its presence mask tells)."""
    if text:
        return lambda rows, metas: [meta[name].encode("utf-8") if name in meta else b"" for meta in metas]
    return lambda rows, metas: [meta.get(name, 0) for meta in metas]


def _present(name: str) -> Values:
    return lambda rows, metas: [name in meta for meta in metas]


def _plan(folder: Path, key_width: int, fields: Mapping[str, _Field], rows: int, first: int
          ) -> tuple[list[_Column], dict[str, Any], list[str]]:
    """The files to write (numbered from ``first``) and, per indexed field, which of them hold its values and
    presence mask."""
    columns: list[_Column] = []

    def add(dtype: np.dtype, values: Values) -> _Column:
        final = folder / f"c{first + len(columns):03d}.npy"
        columns.append(_Column(dtype, values, final, unique_tmp_path(final)))
        return columns[-1]

    layout: dict[str, Any] = {"key": (add(np.dtype(f"S{key_width}"), _keys), None),
                              "label": (add(np.dtype("<i4"), _labels), None)}
    unindexed = []
    for name in sorted(fields):
        info = fields[name]
        dtype = _dtype_of(info.kinds, info.width)
        if dtype is None:
            unindexed.append(name)
            continue
        values = add(dtype, _field(name, dtype.kind == "S"))
        layout[name] = (values, None if info.count == rows else add(np.dtype(bool), _present(name)))
    return columns, layout, unindexed


def write_split_columns(out: Path, split: str, rows: Callable[[], Iterable[Mapping[str, Any]]],
                        expected_rows: int, *, first: int = 0, survey: Survey | None = None) -> dict[str, Any]:
    """Write the columns of ``split`` under ``out/columns/<split>/`` and return its manifest entry
    (``{"rows", "fields", "unindexed"}``).

    ``rows()`` yields the split's source-index rows in column order; it is called twice (survey, then write; once
    when ``survey`` comes filled with the same rows), so memory holds one chunk of ``CHUNK_ROWS`` rows, never the
    whole split. Raises ``ShardcacheError`` when the rows
    counted differ from ``expected_rows`` (the index and the manifest disagree). The caller holds the output lock.
    Files are numbered from ``first``: an append numbers past the files its committed manifest names, so a run
    killed before its commit never changed a file that manifest names.
    """
    out = Path(out)
    folder = out / FOLDER / split
    if survey is None:
        survey = Survey()
        for row in rows():
            survey.add(row)
    count, key_width, fields = survey.count, survey.key_width, survey.fields
    if count != expected_rows:
        raise ShardcacheError(f"the source index has {count} rows for split {split!r}, the manifest counts "
                              f"{expected_rows} samples", path=str(out))
    owned_folder(out, f"{FOLDER}/{split}")  # never through a planted link
    columns, layout, unindexed = _plan(folder, key_width, fields, count, first)
    remove_stale_tmp(folder, {c.final.name for c in columns})  # what a killed writer of these names left
    try:
        for column in columns:
            column.start(count)
        written, stream = 0, iter(rows())
        while chunk := list(itertools.islice(stream, CHUNK_ROWS)):
            written += len(chunk)
            metas = [capped_meta(row.get("meta") or {}) for row in chunk]
            for column in columns:
                column.write(chunk, metas)
        if written != count:
            raise ShardcacheError(f"the source index changed while its columns were written ({written} rows for "
                                  f"split {split!r}, then {count})", path=str(out))
        done = {column.final.name: column.finish() for column in columns}
        for column in columns:  # every file is complete before the first takes its final name
            os.replace(column.tmp, column.final)
        fsync_dir(folder)
    except BaseException:
        for column in columns:
            column.tmp.unlink(missing_ok=True)
        raise

    def entry(column: _Column) -> dict[str, Any]:
        return {"path": f"{FOLDER}/{split}/{column.final.name}", **done[column.final.name]}

    out_fields = {name: {**entry(values), "dtype": values.dtype.str, "present": None if mask is None else entry(mask)}
                  for name, (values, mask) in layout.items()}
    entry_out = {"rows": count, "fields": out_fields, "unindexed": unindexed}
    if survey.dropped() is not None:
        entry_out["dropped"] = survey.dropped()
    return entry_out



def manifest_order(rows: Iterable[Mapping[str, Any]], split: str, shards: Any) -> Iterator[Mapping[str, Any]]:
    """The packed rows of ``split`` among ``rows`` (source-index rows), checked to come in column order: the
    split's ``shards`` (``ShardInfo``) in manifest order, each shard's rows by their recorded position
    (``row``). The source index is written in that order; a mismatch raises, so no row lands on another's place."""
    names = [s.path for s in shards]
    sizes = [s.samples for s in shards]
    shard, position = 0, 0
    for row in rows:
        if row.get("split") != split or not row.get("shard") or row.get("skipped"):
            continue
        while shard < len(names) and position == sizes[shard]:  # that shard's rows are all here: the next one
            shard, position = shard + 1, 0
        recorded = row.get("row")
        expected = shard < len(names) and row["shard"] == names[shard]
        if not expected or type(recorded) is not int or recorded != position:
            raise ShardcacheError(f"the source index's rows of split {split!r} are not in manifest order (sample "
                                  f"{row.get('key')!r:.80} is row {recorded!r} of {row['shard']!r:.80}, expected "
                                  f"row {position} of {names[shard] if shard < len(names) else 'no shard'!r})")
        position += 1
        yield row
