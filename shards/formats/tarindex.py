"""The per-sample byte index of a tar shard: a small versioned sidecar ``<shard>.idx`` written at pack time.

With it a reader fetches exactly a slice of samples: one seek in a local file, one ranged GET on object storage,
instead of walking every header before ``start``. Datasets without it still read by scanning.

Layout (little-endian): 8-byte magic ``b"SCIDX\\0\\1\\0"`` (format name, NUL, version 1, NUL), ``uint64`` count N,
then N+1 ``uint64`` offsets: the byte where each sample's first member header starts, then the end of the last
sample's data (where the end-of-archive marker starts). Samples ``a:b`` are bytes ``offsets[a]:offsets[b]``.

The sidecar is untrusted like every shard byte: ``read_index`` checks the magic and version, the size, the count
against the manifest, that offsets start at 0, rise strictly and end inside the shard; any failure is a
``CorruptDataError`` naming the sidecar. Its sha256 is recorded in the manifest (``ShardInfo.index_sha256``). A
local sidecar is opened through the one door (``shards.door.bounded_read``): a FIFO, device, folder or link loop in
its place is refused unopened, and a file of any size other than the one its sample count implies (a sparse
3 GiB file) is refused on its ``fstat``, before a byte is read.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

import numpy as np

from shards.door.bounded_read import MAX_FILE_BYTES, open_regular_file, read_capped
from shards.errors import ChecksumError, CorruptDataError, MissingInputError
from shards.door.locations import local_shard_path

log = logging.getLogger("shardcache.tarindex")

INDEX_SUFFIX = ".idx"
MAGIC = b"SCIDX\0\1\0"
_HEADER = len(MAGIC) + 8
_OFFSET = np.dtype("<u8")


def index_name(shard_name: str) -> str:
    """``train-000000.tar`` -> ``train-000000.tar.idx``: the sidecar's name beside its shard."""
    return shard_name + INDEX_SUFFIX


def index_bytes(offsets: Sequence[int]) -> bytes:
    """The sidecar's bytes for ``offsets`` (N+1 values: each sample's start, then the end of the last sample)."""
    values = np.asarray(offsets, dtype=np.int64)
    if values.ndim != 1 or len(values) < 1:
        raise ValueError("offsets must be a 1-D sequence of N+1 byte positions")
    if values[0] != 0 or (len(values) > 1 and not np.all(np.diff(values) > 0)):
        raise ValueError("offsets must start at 0 and rise strictly")
    count = len(values) - 1
    return MAGIC + count.to_bytes(8, "little") + values.astype(_OFFSET).tobytes()


def read_index(data: bytes, where: str, samples: int, shard_bytes: int) -> np.ndarray:
    """The N+1 offsets (int64) in ``data``, checked against the manifest's ``samples`` and ``shard_bytes``."""
    def refuse(why: str) -> CorruptDataError:
        return CorruptDataError(f"bad tar index ({why})", path=where)

    if len(data) < _HEADER:
        raise refuse(f"{len(data)} bytes, shorter than its header")
    if data[: len(MAGIC)] != MAGIC:
        if data[:5] == MAGIC[:5]:
            raise refuse(f"unknown version {data[5:8]!r}; upgrade shardcache or repack")
        raise refuse("not a shardcache index: wrong magic")
    count = int.from_bytes(data[len(MAGIC) : _HEADER], "little")
    if count != samples:
        raise refuse(f"holds {count} samples, the manifest says {samples}")
    expected = _HEADER + (count + 1) * _OFFSET.itemsize
    if len(data) != expected:
        raise refuse(f"{len(data)} bytes, expected {expected} for {count} samples")
    raw = np.frombuffer(data, dtype=_OFFSET, offset=_HEADER)
    if np.any(raw > np.uint64(np.iinfo(np.int64).max)):
        raise refuse("offset out of range")
    offsets = raw.astype(np.int64)
    if offsets[0] != 0:
        raise refuse(f"first offset is {int(offsets[0])}, not 0")
    if count and not np.all(np.diff(offsets) > 0):
        raise refuse("offsets do not rise strictly")
    if int(offsets[-1]) > shard_bytes:
        raise refuse(f"last offset {int(offsets[-1])} is past the end of the {shard_bytes}-byte shard")
    return offsets


def index_size(info: Any) -> int:
    """The byte size of a correct sidecar for the shard ``info`` describes (its ``ShardInfo``)."""
    return _HEADER + (info.samples + 1) * _OFFSET.itemsize


def sidecar_of(location: str, info: Any) -> str:
    """Where the sidecar of the shard at ``location`` is (``<shard>.idx``, for messages and object keys), once the
    manifest's name for it is the one its shard implies (else ``CorruptDataError``)."""
    where = f"{location}{INDEX_SUFFIX}"
    if info.index != index_name(info.path):
        raise CorruptDataError(f"the manifest names index {info.index!r} for shard {info.path!r}; expected "
                               f"{index_name(info.path)!r}", path=where)
    return where


def checked_index(data: bytes, where: str, info: Any) -> np.ndarray:
    """The offsets in a sidecar's bytes ``data``, wherever they were read: the size its sample count implies, the
    manifest's ``index_sha256``, then the layout (``read_index``); else ``CorruptDataError``/``ChecksumError``."""
    expected = index_size(info)
    if len(data) != expected:
        raise CorruptDataError(f"bad tar index ({len(data)} bytes, expected {expected} for {info.samples} samples)",
                               path=where)
    if info.index_sha256 is not None and hashlib.sha256(data).hexdigest() != info.index_sha256:
        raise ChecksumError("sha256 of the tar index does not match the manifest", path=where)
    return read_index(data, where, info.samples, info.bytes)


def load_local_index(location: str | os.PathLike, info: Any) -> np.ndarray | None:
    """The checked offsets of the local shard at ``location`` (``info``: its ``ShardInfo``), or None when the
    manifest records no index (older datasets) or the sidecar file is gone: the caller then scans the headers.

    The sidecar must be named ``<shard>.idx`` and lie inside the dataset folder after symlinks are followed (the
    shards' rule, ``local_shard_path``: else ``ManifestError``), and pass ``checked_index``.
    """
    if getattr(info, "index", None) is None:
        return None
    where = sidecar_of(str(location), info)
    path = local_shard_path(_names_root(Path(location), info.path), info.index, where=where, what="tar index")
    try:
        handle = open_regular_file(path, error=CorruptDataError)
    except MissingInputError:
        log.warning("%s: tar index missing; reading the shard by scanning its headers", where)
        return None
    with handle:
        size, expected = os.fstat(handle.fileno()).st_size, index_size(info)
        # Refused before reading: a sidecar swapped for a large file (or a manifest counting absurd samples, whose
        # sidecar would be larger than shardcache reads whole) is never read.
        if size != expected or size > MAX_FILE_BYTES:
            too_large = ", more than shardcache reads whole" if size > MAX_FILE_BYTES else ""
            raise CorruptDataError(f"bad tar index ({size} bytes, expected {expected} for {info.samples} samples"
                                   f"{too_large})", path=where)
        data = read_capped(handle, where, limit=size, error=CorruptDataError)  # it may have grown since
    return checked_index(data, where, info)


def _names_root(shard: Path, name: str) -> Path:
    """The folder the manifest's names are relative to: ``shard`` is ``folder / name`` as ``shard_location`` made
    it (a location the caller chose otherwise: its own folder)."""
    parts = PurePosixPath(name).parts
    return shard.parents[len(parts) - 1] if shard.parts[-len(parts):] == parts else shard.parent


__all__ = ["INDEX_SUFFIX", "MAGIC", "checked_index", "index_bytes", "index_name", "index_size", "load_local_index",
           "read_index", "sidecar_of"]
