"""The column index: a split's per-sample fields as one NumPy ``.npy`` file per column, written at pack time.

Selection code (filters, class subsets, metadata queries) must not read a million-line ``source-index.jsonl`` into
Python objects; it maps fixed-width columns instead. Layout: ``<dataset>/columns/<split>/c<NNN>.npy`` (a field's
name comes from an untrusted source, so it is never a file name). Row i of every column of a split is the split's
i-th sample in manifest order (its shards in ``dataset.json`` order, rows in shard order); skipped files have no
row. ``dataset.json`` records each file's path, size, sha256 and dtype under ``extra["columns"]``
(``COLUMNS_KEY``); docs/design.md describes the format.

Writing streams: ``write_split_columns`` reads the rows twice (types and widths, then values) and writes chunks
of ``CHUNK_ROWS`` rows, so memory does not grow with the number of samples; every file goes to a temp name, is
fsynced, and all of a split's files are renamed only once all are complete.

Reading trusts nothing on disk: the ``.npy`` header is parsed here from a bounded read (version 1.0, C order,
1-D, a dtype ``allowed_dtype`` accepts; never pickles), the file's size must be exactly header + rows * itemsize,
and its sha256 must equal the manifest's (hashed once per process per file, streamed) before the file is mapped
read-only. A remote dataset's column files are copied (into the node cache when there is one) and mapped there.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np

from shards.atomic import fsync_dir, remove_stale_tmp, unique_tmp_path
from shards.errors import CorruptDataError, ManifestError, ShardcacheError
from shards.formats.location import Location, locate

COLUMNS_KEY = "columns"
FORMAT = "npy-1"
FOLDER = "columns"
CHUNK_ROWS = 1 << 13  # rows held at once while writing: a few MB of row objects
HASH_BLOCK = 1 << 20
MAX_HEADER = 65535 + 10  # magic, version, 2-byte length, and the longest header version 1.0 allows
INT64 = (-(1 << 63), (1 << 63) - 1)
FLOAT_EXACT = 1 << 53  # ints beyond this lose digits in a float64 column, so mixed with floats they get none
# The only dtypes a column may have: no objects (pickles), no big-endian or structured types.
_FIXED = {"|b1": np.dtype(bool), "<i4": np.dtype("<i4"), "<i8": np.dtype("<i8"), "<f8": np.dtype("<f8")}
_BYTES = re.compile(r"^\|S([1-9][0-9]{0,8})$")
_RESERVED = ("key", "label", "class")  # the sample's own key and label win; class is classes[label]


def allowed_dtype(text: object) -> np.dtype | None:
    """The dtype a manifest's ``dtype`` string names if it is one a column may have, else None."""
    if not isinstance(text, str):
        return None
    if text in _FIXED:
        return _FIXED[text]
    return np.dtype(text) if _BYTES.match(text) else None


# -- writing ------------------------------------------------------------------------------------------------------

_KIND = {bool: "bool", int: "int", float: "float", str: "str"}


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
        for name, value in meta.items():
            info = fields.get(name)
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

    @property
    def fields(self) -> dict[str, _Field]:
        """The metadata fields that may get a column: the sample's own key and label win, class is derived."""
        return {name: info for name, info in self._fields.items() if name not in _RESERVED}


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
    folder.mkdir(parents=True, exist_ok=True)
    columns, layout, unindexed = _plan(folder, key_width, fields, count, first)
    remove_stale_tmp(folder, {c.final.name for c in columns})  # what a killed writer of these names left
    try:
        for column in columns:
            column.start(count)
        written, stream = 0, iter(rows())
        while chunk := list(itertools.islice(stream, CHUNK_ROWS)):
            written += len(chunk)
            metas = [row.get("meta") or {} for row in chunk]
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
    return {"rows": count, "fields": out_fields, "unindexed": unindexed}


def column_file_entries(entry: Any) -> Iterator[tuple[str, int | None, str | None]]:
    """``(path, bytes, sha256)`` of every file a ``columns`` entry names (for verify and publishing)."""
    splits = entry.get("splits") if isinstance(entry, Mapping) else None
    for split in (splits.values() if isinstance(splits, Mapping) else ()):
        fields = split.get("fields") if isinstance(split, Mapping) else None
        for spec in (fields.values() if isinstance(fields, Mapping) else ()):
            for item in (spec, spec.get("present") if isinstance(spec, Mapping) else None):
                if isinstance(item, Mapping) and isinstance(item.get("path"), str):
                    yield item["path"], item.get("bytes"), item.get("sha256")


def column_files(entry: Any) -> list[str]:
    """The paths of every file a ``columns`` entry names."""
    return [path for path, _, _ in column_file_entries(entry)]


def next_column_number(split_entry: Any) -> int:
    """One past the highest file number a split's committed ``columns`` entry uses (0 for none)."""
    numbers = [int(m.group(1)) for path in column_files({"splits": {"": split_entry}})
               if (m := re.search(r"/c(\d+)\.npy$", path))]
    return max(numbers, default=-1) + 1


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


# -- reading ------------------------------------------------------------------------------------------------------

_VERIFIED: set[tuple[Any, ...]] = set()  # (device, inode, size, mtime_ns, sha256) of files hashed in this process


def _header(handle: Any, shown: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """The dtype, shape, order and data offset of the ``.npy`` file ``handle``, from at most ``MAX_HEADER``
    bytes; a file that is not a version 1.0 ``.npy`` is ``CorruptDataError``."""
    try:
        version = np.lib.format.read_magic(handle)
        if version != (1, 0):
            raise ValueError(f"format version {version}, expected (1, 0)")
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle, max_header_size=MAX_HEADER)
    except (ValueError, EOFError, SyntaxError, TypeError) as exc:
        raise CorruptDataError(f"not a readable .npy column ({str(exc).splitlines()[0][:200]})", path=shown) from None
    return dtype, shape, fortran, handle.tell()


def _sha256(handle: Any) -> str:
    digest = hashlib.sha256()
    handle.seek(0)
    while block := handle.read(HASH_BLOCK):
        digest.update(block)
    return digest.hexdigest()


def map_column(path: Path, spec: Mapping[str, Any], rows: int, dtype: np.dtype, shown: str, *,
               recheck: bool = False) -> np.ndarray:
    """The checked, read-only array of the column file ``path`` (``spec``: its manifest entry; ``shown``: its name
    in messages). The sha256 is hashed once per process per file, or every time with ``recheck``."""
    try:
        handle = open(path, "rb")
    except FileNotFoundError:
        raise CorruptDataError("column file listed in the manifest is missing", path=shown) from None
    with handle:
        stat = os.fstat(handle.fileno())
        expected_bytes = spec.get("bytes")
        if stat.st_size != expected_bytes:
            raise CorruptDataError(f"{stat.st_size} bytes, the manifest records {expected_bytes} "
                                   "(truncated, extended or replaced)", path=shown)
        found, shape, fortran, offset = _header(handle, shown)
        if found.hasobject or found != dtype or found.str != dtype.str:
            raise CorruptDataError(f"dtype {found.str}, the manifest records {dtype.str}", path=shown)
        if fortran or shape != (rows,):
            raise CorruptDataError(f"shape {shape}{' in Fortran order' if fortran else ''}, expected ({rows},) "
                                   "in C order", path=shown)
        if offset + rows * dtype.itemsize != stat.st_size:
            raise CorruptDataError(f"{stat.st_size} bytes, a ({rows},) {dtype.str} column is "
                                   f"{offset + rows * dtype.itemsize}", path=shown)
        key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, spec.get("sha256"))
        if recheck or key not in _VERIFIED:
            if _sha256(handle) != spec.get("sha256"):
                raise CorruptDataError("sha256 does not match the manifest (corrupt or replaced)", path=shown)
            _VERIFIED.add(key)
        if rows == 0:
            empty = np.empty(0, dtype)
            empty.flags.writeable = False
            return empty
        return np.memmap(handle, dtype=dtype, mode="r", offset=offset, shape=(rows,))


class _Fetched:
    """Local copies of a remote dataset's column files: in the node cache when one is given, else in a private
    temp folder removed at exit."""

    def __init__(self, cache: Any):
        from shards.cache.cached_shards import CachedShards
        from shards.cache.node import NodeCache, ShardCache

        if isinstance(cache, CachedShards):
            cache = cache.request
        if isinstance(cache, (str, os.PathLike)):
            cache = ShardCache(dir=cache)
        if isinstance(cache, ShardCache):
            cache = NodeCache(cache) if cache.dir is not None else None
        self.node: NodeCache | None = cache
        self.leases: list[Any] = []  # held while the columns are: the cache does not evict a mapped copy
        self.folder: Path | None = None

    def copy(self, where: Location, size: int, sha256: str) -> Path:
        if self.node is not None:
            def fetch(out: Any) -> None:
                with where.open() as stream:
                    shutil.copyfileobj(stream, out, HASH_BLOCK)
            try:
                lease = self.node.acquire(sha256, size, ".npy", fetch, str(where))
            except CorruptDataError as exc:
                raise CorruptDataError(exc.reason, path=str(where)) from None
            if lease is not None:
                self.leases.append(lease)
                return lease.path
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="shardcache-columns-"))
            atexit.register(shutil.rmtree, self.folder, True)
        path = self.folder / f"{sha256}.npy"
        if not path.exists():
            tmp = unique_tmp_path(path)
            with where.open() as stream, open(tmp, "wb") as out:
                copied = 0
                while copied <= size and (data := stream.read(HASH_BLOCK)):  # never more than size + a block
                    out.write(data)
                    copied += len(data)
            os.replace(tmp, path)
        return path


class SplitColumns:
    """One split's columns, opened lazily: each file is checked and mapped on first use."""

    def __init__(self, base: Location, split: str, entry: Mapping[str, Any], *, where: str, cache: Any = None):
        self.base = base
        self.split = split
        self.where = where
        rows = entry.get("rows")
        fields = entry.get("fields")
        unindexed = entry.get("unindexed", [])
        if (type(rows) is not int or rows < 0 or not isinstance(fields, Mapping)
                or not isinstance(unindexed, list) or not all(isinstance(n, str) for n in unindexed)):
            raise ManifestError(f"malformed columns entry for split {split!r}", path=where)
        self.rows: int = rows
        # key and label first, then the metadata fields (dataset.json stores its keys sorted)
        self.fields: tuple[str, ...] = tuple(sorted(fields, key=lambda name: (name not in ("key", "label"),
                                                                              name != "key")))
        self.unindexed: tuple[str, ...] = tuple(unindexed)
        self._specs = dict(fields)
        for name, spec in self._specs.items():
            self._check_spec(name, spec)
        self._cache = cache
        self._fetched: _Fetched | None = None
        self._arrays: dict[str, np.ndarray] = {}
        self._masks: dict[str, np.ndarray] = {}

    def _check_spec(self, name: str, spec: Any) -> None:
        def ok(item: Any) -> bool:
            return (isinstance(item, Mapping) and isinstance(item.get("path"), str)
                    and type(item.get("bytes")) is int and isinstance(item.get("sha256"), str))
        present = spec.get("present") if isinstance(spec, Mapping) else None
        if not ok(spec) or allowed_dtype(spec.get("dtype")) is None or not (present is None or ok(present)):
            raise ManifestError(f"malformed or unsupported column {name!r:.80} of split {self.split!r} "
                                f"(dtype {spec.get('dtype') if isinstance(spec, Mapping) else None!r:.40})",
                                path=self.where)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_arrays={}, _masks={}, _fetched=None)  # mapped again (and checked once) in each process
        return state

    def _open(self, spec: Mapping[str, Any], dtype: np.dtype) -> np.ndarray:
        where = self.base.child(spec["path"], where=self.where, what="column file")
        if where.is_local:
            return map_column(where.path, spec, self.rows, dtype, str(where))
        if self._fetched is None:
            self._fetched = _Fetched(self._cache)
        path = self._fetched.copy(where, spec["bytes"], spec["sha256"])
        return map_column(path, spec, self.rows, dtype, str(where))

    def column(self, name: str) -> np.ndarray:
        """The read-only values of field ``name`` (``KeyError`` if it has no column); rows without the field hold
        0 / False / b"" (see ``present``)."""
        if name not in self._arrays:
            spec = self._specs[name]
            self._arrays[name] = self._open(spec, allowed_dtype(spec["dtype"]))
        return self._arrays[name]

    def present(self, name: str) -> np.ndarray | None:
        """Which rows have field ``name`` (a bool array), or None when every row has it."""
        spec = self._specs[name]["present"]
        if spec is None:
            return None
        if name not in self._masks:
            self._masks[name] = self._open(spec, np.dtype(bool))
        return self._masks[name]

    def files(self) -> Iterator[tuple[Mapping[str, Any], np.dtype]]:
        """The manifest entry and dtype of every file of this split (each column, then its mask, if any)."""
        for spec in self._specs.values():
            yield spec, allowed_dtype(spec["dtype"])
            if spec["present"] is not None:
                yield spec["present"], np.dtype(bool)


def open_columns(base: Location | str | os.PathLike, manifest: Any, split: str, *,
                 cache: Any = None) -> SplitColumns | None:
    """The columns of ``split`` of the dataset at ``base`` (its folder or prefix), or None when its manifest
    records none (a dataset packed before columns existed: read the source index as before)."""
    base = locate(base)
    where = str(base.file(getattr(manifest, "FILE", "dataset.json")))
    entry = manifest.extra.get(COLUMNS_KEY)
    if entry is None:
        return None
    if not isinstance(entry, Mapping) or entry.get("format") != FORMAT or not isinstance(entry.get("splits"), Mapping):
        found = entry.get("format") if isinstance(entry, Mapping) else entry
        raise ManifestError(f"unknown columns format {found!r:.40} (this version reads {FORMAT!r})", path=where)
    split_entry = entry["splits"].get(split)
    if split_entry is None:
        return None
    if not isinstance(split_entry, Mapping):
        raise ManifestError(f"malformed columns entry for split {split!r}", path=where)
    columns = SplitColumns(base, split, split_entry, where=where, cache=cache)
    samples = manifest.splits[split].samples if split in manifest.splits else None
    if columns.rows != samples:
        raise ManifestError(f"the columns of split {split!r} have {columns.rows} rows, the split "
                            f"{'is not in the manifest' if samples is None else f'has {samples} samples'}",
                            path=where)
    return columns


def verify_columns(base: Location | str | os.PathLike, manifest: Any) -> list[str]:
    """Every problem with the column files ``manifest`` names (``shards verify``): each is read once, a remote
    one copied, and held to the reader's checks (size, header, sha256, hashed again here); one line each."""
    base = locate(base)
    problems: list[str] = []
    entry = manifest.extra.get(COLUMNS_KEY)
    for split in (entry.get("splits", {}) if isinstance(entry, Mapping) else {}):
        try:
            columns = open_columns(base, manifest, split)
        except ShardcacheError as exc:
            problems.append(str(exc))
            continue
        if columns is None:
            continue
        for item, dtype in columns.files():
            try:
                where = base.child(item["path"], where=columns.where, what="column file")
                with where.local_copy(item["bytes"] + 1) as path:
                    map_column(path, item, columns.rows, dtype, item["path"], recheck=True)
            except ShardcacheError as exc:
                problems.append(f"{item['path']}: {exc.reason}" if isinstance(exc, CorruptDataError) else str(exc))
    return problems
