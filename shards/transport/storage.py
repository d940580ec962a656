"""The storage registry: one entry per image-shard format, so callers never branch on format names.

Each entry says how to write a shard, read it whole (checks, featurising, appends), read one slice of it (the
streaming reader), read it as a stream from a non-seekable location (``None`` where the format cannot be), read a
slice of it on object storage (``shards.transport.s3shards``: tar by its byte index in one ranged GET, HDF5 through a
block-cached file object), and read it from bytes already in memory (a fetched and checked object).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from shards.errors import CorruptDataError, InputError
from shards.formats.adopted import iter_adopted_slice, load_rows, no_stream_read
from shards.formats.hdf5 import Hdf5ShardWriter, iter_hdf5_shard, iter_hdf5_slice
from shards.formats.sample import RawSample
from shards.formats.tar import TarShardWriter, iter_tar_shard
from shards.formats.tarseek import iter_tar_slice, iter_tar_stream


@dataclass(frozen=True)
class Storage:
    name: str
    suffix: str
    writer: type
    read: Callable[..., Iterator[RawSample]]  # (path) -> every sample
    # The three streaming reads take ``resync=True``: a damaged sample is yielded as its ``CorruptDataError`` and
    # reading goes on with the next (``shards.formats.tarseek``); by default the first one raises.
    read_slice: Callable[..., Iterator[RawSample]]  # (path, start, stop, *, sha256=None) -> samples start:stop
    read_stream: Callable[..., Iterator[RawSample]] | None  # (binary stream, where) -> every sample
    # (s3 URL, start, stop, S3Options, *, size, offsets) -> samples start:stop of a shard on object storage
    read_s3_slice: Callable[..., Iterator[RawSample]]
    read_bytes: Callable[[bytes, str], Iterator[RawSample]]  # (a whole shard's bytes, where) -> every sample
    indexed: bool = False  # read_slice takes ``offsets=`` (a per-sample byte index, see shards.formats.tarindex)
    # Adopted tars (``shards.formats.adopted``): the index is under the manifest's folder, not beside the shards
    # (``load_index(index folder location, ShardInfo)``), and every read needs it.
    load_index: Callable[..., Any] | None = None


def _tar_s3_slice(location: str, start: int, stop: int, options: Any, *, size: int,
                  offsets: Any = None, resync: bool = False) -> Iterator[RawSample]:
    from shards.transport.s3shards import iter_s3_tar_slice  # object storage only when asked for

    return iter_s3_tar_slice(location, start, stop, options, offsets, resync=resync)


def _hdf5_s3_slice(location: str, start: int, stop: int, options: Any, *, size: int,
                   offsets: Any = None, resync: bool = False) -> Iterator[RawSample]:
    from shards.transport.s3shards import iter_s3_hdf5_slice

    return iter_s3_hdf5_slice(location, start, stop, options, size, resync=resync)


def _adopted_s3_slice(location: str, start: int, stop: int, options: Any, *, size: int,
                      offsets: Any = None, resync: bool = False) -> Iterator[RawSample]:
    """Rows ``start:stop`` of an adopted tar on S3: the bytes they span in parallel ranged parts."""
    from shards.formats.adopted import iter_adopted_stream, row_span
    from shards.transport.s3_parallel import open_parts

    if offsets is None:
        raise CorruptDataError("an adopted tar is read by its row index, and none was loaded", path=location)
    first, last = row_span(offsets, start, stop)
    if first < last:
        with open_parts(location, first, last, options) as stream:
            yield from iter_adopted_stream(io.BufferedReader(stream, 1 << 20), location, offsets, start, stop,
                                           resync=resync)


def _tar_bytes(data: bytes, where: str) -> Iterator[RawSample]:
    return iter_tar_stream(io.BytesIO(data), where)


def _hdf5_bytes(data: bytes, where: str) -> Iterator[RawSample]:
    return iter_hdf5_shard(io.BytesIO(data), where=where)


STORAGES: dict[str, Storage] = {
    "tar": Storage("tar", ".tar", TarShardWriter, iter_tar_shard, iter_tar_slice, iter_tar_stream, _tar_s3_slice,
                   _tar_bytes, indexed=True),
    "hdf5": Storage("hdf5", ".h5", Hdf5ShardWriter, iter_hdf5_shard, iter_hdf5_slice, None, _hdf5_s3_slice,
                    _hdf5_bytes),
}
# Formats shardcache reads but never writes: WebDataset tars indexed in place (``shards index``), read through
# their row index only.
READ_ONLY: dict[str, Storage] = {
    "wds": Storage("wds", ".tar", type(None), no_stream_read, iter_adopted_slice, None, _adopted_s3_slice,
                   no_stream_read, indexed=True, load_index=load_rows),
}


def get_storage(name: str) -> Storage:
    """The storage a manifest names, written by shardcache or only read by it."""
    found = STORAGES.get(name) or READ_ONLY.get(name)
    if found is None:
        raise InputError(f"unknown storage {name!r}; choose one of {sorted(STORAGES)}")
    return found


def writable_storage(name: str) -> Storage:
    """A storage shardcache writes shards in (``pack-shards --storage``)."""
    if name not in STORAGES:
        raise InputError(f"unknown storage {name!r}; choose one of {sorted(STORAGES)}")
    return STORAGES[name]


def shard_name(split: str, index: int, storage: str) -> str:
    """``train-000012.tar``: the name every stage expects for shard ``index`` of ``split``."""
    return f"{split}-{index:06d}{get_storage(storage).suffix}"
