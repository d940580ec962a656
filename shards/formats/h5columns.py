"""What shardcache's HDF5 files (image shards, ``shards.formats.hdf5``; feature shards, ``shards.formats.features``)
hold for text, and the checks every dataset passes before a byte of it is read.

Text columns hold no variable-length data. A variable-length string dataset stores references into HDF5's global
heap, and libhdf5's C reader follows a corrupt reference into a loop it never leaves (issue 33): once h5py asks,
no check on the Python side can stop it. So a column of ``N`` strings is two plain arrays (docs/design.md,
2.2):

    <name>_bytes  uint8[total]   every value's UTF-8 bytes, concatenated
    <name>_ends   uint64[N]      value i is <name>_bytes[ends[i - 1]:ends[i]] (ends[-1] == total)

both contiguous and uncompressed, which leaves the reader nothing to follow: each is checked (a dataset of that
dtype, contiguous, unfiltered, not virtual nor stored in another file, its bytes inside the file) and its ends
against the sample count before they are read, then sliced in numpy. The layout is the file's ``version``
attribute (an integer, checked by its type before it is read); a 0.x reads only its own layout (no read-both).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from shards.errors import CorruptDataError

VERSION_ATTR = "version"


def write_text_column(f: Any, name: str, values: Iterable[str]) -> None:
    """``<name>_bytes`` and ``<name>_ends`` of ``values`` into the open, writable ``h5py.File`` ``f``."""
    encoded = [value.encode("utf-8") for value in values]
    ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.uint64, count=len(encoded)), dtype=np.uint64)
    # track_times=False keeps the file byte-identical across runs; no chunks, no filters: contiguous and plain.
    f.create_dataset(f"{name}_bytes", data=np.frombuffer(b"".join(encoded), dtype=np.uint8), track_times=False)
    f.create_dataset(f"{name}_ends", data=ends, track_times=False)


def checked_dataset(f: Any, name: str, file_bytes: int, where: str, *, contiguous: bool = False,
                    what: str = "corrupt HDF5 file") -> Any:
    """The dataset ``name`` of ``f``, before any of it is read: a dataset (not a group or a dangling link), not
    virtual nor stored in another file, with a shape and no filters (as shardcache writes it), declaring no more
    bytes than the file holds (a forged shape never allocates more than the file's size); ``contiguous``: also
    stored in one piece, inside the file. ``what`` begins the message."""
    import h5py

    dataset = f.get(name)
    if not isinstance(dataset, h5py.Dataset):
        raise CorruptDataError(f"{what}: no dataset {name!r}", path=where)
    if dataset.shape is None or dataset.is_virtual or dataset.external \
            or dataset.id.get_create_plist().get_nfilters():
        raise CorruptDataError(f"{what}: dataset {name!r} is empty, filtered, virtual or stored outside the file "
                               "(shardcache writes it plain)", path=where)
    declared = int(np.prod(dataset.shape, dtype=np.float64)) * max(dataset.dtype.itemsize, 1)
    if declared > file_bytes:
        raise CorruptDataError(f"{what}: dataset {name!r} declares {declared} bytes, more than the "
                               f"{file_bytes}-byte file", path=where)
    if contiguous:
        offset = dataset.id.get_offset()
        if dataset.chunks is not None or (declared and (offset is None or offset + declared > file_bytes)):
            raise CorruptDataError(f"{what}: dataset {name!r} is not stored in one piece inside the file",
                                   path=where)
    return dataset


def check_version(f: Any, expected: int, where: str, what: str, fix: str) -> None:
    """``CorruptDataError`` unless the file's ``version`` attribute is the integer ``expected``: a file of the old
    layout (a variable-length ``keys`` dataset) is refused by name, never read. The attribute's type is checked
    before its value is read (a string attribute would be variable-length data too)."""
    found: object = None
    if VERSION_ATTR in f.attrs:
        attr = f.attrs.get_id(VERSION_ATTR)
        if attr.dtype.kind in "iu" and attr.shape == ():
            found = int(f.attrs[VERSION_ATTR])
        else:
            found = "not an integer"
    if found == expected:
        return
    if "keys" in f and "key_ends" not in f:
        raise CorruptDataError(f"{what} of the old layout (variable-length keys, before layout version {expected}); "
                               f"this shardcache reads only version {expected}: {fix}", path=where)
    raise CorruptDataError(f"{what} layout version {found!r}, this shardcache reads version {expected}: {fix}",
                           path=where)


def read_text_column(f: Any, name: str, rows: int, file_bytes: int, where: str, start: int = 0,
                     stop: int | None = None, *, what: str = "corrupt HDF5 file") -> list[str]:
    """Values ``start:stop`` of the text column ``name`` (``rows`` values in all: the sample count the caller
    holds), every size checked before it is read; ``CorruptDataError`` naming the file when they do not hold
    together (``what`` begins the message). Only the ends of the rows asked for, and the last, are read."""
    blob = checked_dataset(f, f"{name}_bytes", file_bytes, where, contiguous=True, what=what)
    ends_set = checked_dataset(f, f"{name}_ends", file_bytes, where, contiguous=True, what=what)
    if blob.dtype != np.uint8 or ends_set.dtype.kind != "u" or ends_set.dtype.itemsize != 8 \
            or len(blob.shape) != 1 or ends_set.shape != (rows,):
        raise CorruptDataError(f"{what}: {name}_bytes is {blob.dtype} {blob.shape} and {name}_ends {ends_set.dtype} "
                               f"{ends_set.shape}, expected uint8 [bytes] and uint64 [{rows}]", path=where)
    total = int(blob.shape[0])
    last = int(ends_set[rows - 1]) if rows else 0
    if last != total:
        raise CorruptDataError(f"{what}: {name}_ends ends at {last}, but {name}_bytes holds {total} bytes",
                               path=where)
    stop = rows if stop is None else min(stop, rows)
    if start >= stop:
        return []
    ends = np.asarray(ends_set[max(start - 1, 0):stop], dtype=np.uint64)
    bounds = np.concatenate([np.zeros(1, dtype=np.uint64), ends]) if start == 0 else ends
    if np.any(bounds[1:] < bounds[:-1]) or int(bounds[-1]) > total:
        raise CorruptDataError(f"{what}: {name}_ends are not increasing within the {total}-byte {name}_bytes",
                               path=where)
    lo = int(bounds[0])
    data = blob[lo:int(bounds[-1])].tobytes()
    values = []
    for row, (begin, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist()), start):
        try:
            values.append(data[begin - lo:end - lo].decode("utf-8"))
        except UnicodeDecodeError:
            raise CorruptDataError(f"{what}: {name} {row} is not UTF-8 text", path=where) from None
    return values
