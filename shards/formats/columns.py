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
are copied (into the node cache when there is one) and mapped there by ``shards.select.columns``, which opens a
split's columns from any location. That a column holds what the shards hold is
``shards verify``'s to check (``shards.check.verify``): it reads the shards anyway.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from shards.door.bounded_read import open_regular_file
from shards.errors import CorruptDataError, MissingInputError

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
_BYTES = re.compile(r"^\|S([1-9][0-9]{0,8})\Z")


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
               if (m := re.search(r"/c(\d+)\.npy\Z", path))]
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
