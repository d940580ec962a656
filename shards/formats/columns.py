"""The column index: a split's per-sample fields as one NumPy ``.npy`` file per column, written at pack time.

Selection code (filters, class subsets, metadata queries) must not read a million-line ``source-index.jsonl`` into
Python objects; it maps fixed-width columns instead. Layout: ``<dataset>/columns/<split>/c<NNN>.npy`` (a field's
name comes from an untrusted source, so it is never a file name). Row i of every column of a split is the split's
i-th sample in manifest order (its shards in ``dataset.json`` order, rows in shard order); skipped files have no
row. ``dataset.json`` records each file's path, size, sha256 and dtype under ``extra["columns"]``
(``COLUMNS_KEY``); docs/design.md describes the format.

Writing is ``shards.formats.column_writer``'s; this module holds the format's constants, the manifest entry's
helpers and reading.

Reading trusts nothing on disk: a column file is opened through the one door (``shards.door.bounded_read``: a
FIFO, device, socket, folder or link loop in its place is one ``CorruptDataError`` naming it, never opened), its
size must be the manifest's before a byte is read (a sparse 3 GiB file is refused on its ``fstat``), the ``.npy``
header is matched here from a bounded read (version 1.0 as NumPy writes it, C order, 1-D, a dtype
``allowed_dtype`` accepts; never pickles, never NumPy's own header parser), the file's size must be exactly header + rows * itemsize, and its sha256 must equal the manifest's
(hashed once per process per file, streamed) before the file is mapped read-only. A remote dataset's column files
are copied (into the node cache when there is one) and mapped there. That a column holds what the shards hold is
``shards verify``'s to check (``shards.check.verify``): it reads the shards anyway.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from shards.atomic import unique_tmp_path
from shards.door.bounded_read import open_regular_file
from shards.errors import CorruptDataError, ManifestError, MissingInputError, ShardcacheError
from shards.transport.location import Location, locate

COLUMNS_KEY = "columns"
FORMAT = "npy-1"
FOLDER = "columns"
HASH_BLOCK = 1 << 20
NPY_MAGIC = b"\x93NUMPY"
# A version 1.0 ``.npy`` header as NumPy writes it: ``{'descr': '<i8', 'fortran_order': False, 'shape': (7,), }``.
_NPY_HEADER = re.compile(r"\{'descr': '(?P<descr>[^'\\]{1,40})', 'fortran_order': (?P<fortran>False|True), "
                         r"'shape': \((?P<shape>(?:\d{1,19}(?:, \d{1,19})*,?)?)\), \} *\n")
# The only dtypes a column may have: no objects (pickles), no big-endian or structured types.
_FIXED = {"|b1": np.dtype(bool), "<i4": np.dtype("<i4"), "<i8": np.dtype("<i8"), "<f8": np.dtype("<f8")}
_BYTES = re.compile(r"^\|S([1-9][0-9]{0,8})$")


def allowed_dtype(text: object) -> np.dtype | None:
    """The dtype a manifest's ``dtype`` string names if it is one a column may have, else None."""
    if not isinstance(text, str):
        return None
    if text in _FIXED:
        return _FIXED[text]
    return np.dtype(text) if _BYTES.match(text) else None


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


# -- reading ------------------------------------------------------------------------------------------------------

_VERIFIED: set[tuple[Any, ...]] = set()  # (device, inode, size, mtime_ns, sha256) of files hashed in this process


def _header(handle: Any, shown: str) -> tuple[str, tuple[int, ...], bool, int]:
    """The dtype (its descr), shape, order and data offset of the ``.npy`` file ``handle``; a file that is not a
    version 1.0 ``.npy`` with the header NumPy writes is ``CorruptDataError``.

    The header is matched here, never handed to NumPy's reader: that one runs Python's tokenizer and
    ``ast.literal_eval`` over up to 64 KiB of untrusted text, which raise errors of their own and can take
    hundreds of MB on a nested one. Every NumPy writer produces this one form (keys sorted, padded with spaces)."""
    def refuse(why: str) -> CorruptDataError:
        return CorruptDataError(f"not a readable .npy column ({why})", path=shown)

    prefix = handle.read(10)  # magic, version, header length
    if len(prefix) < 10 or prefix[:6] != NPY_MAGIC:
        raise refuse("no .npy magic")
    if prefix[6:8] != b"\x01\x00":
        raise refuse(f"format version ({prefix[6]}, {prefix[7]}), expected (1, 0)")
    length = int.from_bytes(prefix[8:10], "little")
    text = handle.read(length)
    match = _NPY_HEADER.fullmatch(text.decode("latin-1")) if len(text) == length else None
    if match is None:
        raise refuse(f"a header other than NumPy writes: {text[:60]!r}")
    shape = tuple(int(size) for size in match["shape"].replace(",", " ").split())
    return match["descr"], shape, match["fortran"] == "True", len(prefix) + length


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
        handle = open_regular_file(path, error=CorruptDataError)
    except MissingInputError:
        raise CorruptDataError("column file listed in the manifest is missing", path=shown) from None
    except CorruptDataError as exc:  # named as the caller shows it
        raise CorruptDataError(exc.reason, path=shown) from None
    with handle:
        stat = os.fstat(handle.fileno())
        expected_bytes = spec.get("bytes")
        if stat.st_size != expected_bytes:
            raise CorruptDataError(f"{stat.st_size} bytes, the manifest records {expected_bytes} "
                                   "(truncated, extended or replaced)", path=shown)
        found, shape, fortran, offset = _header(handle, shown)
        if found != dtype.str:
            raise CorruptDataError(f"dtype {found}, the manifest records {dtype.str}", path=shown)
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
        spec = self._specs[name].get("present")
        if spec is None:
            return None
        if name not in self._masks:
            self._masks[name] = self._open(spec, np.dtype(bool))
        return self._masks[name]

    def path_of(self, name: str) -> str:
        """The manifest's path of field ``name``'s column file (``KeyError`` if it has no column)."""
        return self._specs[name]["path"]

    def files(self) -> Iterator[tuple[Mapping[str, Any], np.dtype]]:
        """The manifest entry and dtype of every file of this split (each column, then its mask, if any)."""
        for spec in self._specs.values():
            yield spec, allowed_dtype(spec["dtype"])
            if spec.get("present") is not None:
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
    splits = entry.get("splits") if isinstance(entry, Mapping) else None
    if entry is not None and not isinstance(splits, Mapping):  # open_columns names what is wrong with it
        splits = {name: None for name in manifest.splits}
    for split in (splits or {}):
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
