"""Shards on object storage: each format read from ``s3://`` by byte range, checked like a local file.

- Tar: with the manifest's per-sample index (``ShardInfo.index``, ``shards.formats.tarindex``) a slice is the index
  (fetched once per process, checked against its recorded size and sha256) plus exactly the bytes
  ``[offsets[start], offsets[stop])`` (``tar_slice_range``), in parallel parts (``shards.transport.s3_parallel``; one
  GET up to ``PART`` bytes, or the stream a read-ahead opened), parsed from its first header. Without an index
  (older datasets) the shard streams from byte 0 and the samples before ``start`` are read and dropped, as over
  ``http(s)``.
- HDF5: ``S3File``, a seekable read-only file object over ranged GETs with a block cache, handed to h5py, which
  reads the metadata and then only the data chunks of the slice (sequential misses fetch growing read-ahead, in
  parallel parts once it is longer than one part).

Whole objects (feature shards, ``shards verify``, the node cache) stream through the location in parallel parts
(``shards.transport.location.S3Object``: ``fetch_checked`` hashes it on the way).
"""

from __future__ import annotations

import io
import itertools
import logging
import os
from collections import OrderedDict
from typing import Any, Callable, ContextManager, Iterator

import numpy as np

from shards.errors import CorruptDataError, MissingInputError
from shards.transport import parallel_parts
from shards.transport.s3 import S3Options
from shards.transport.s3_parallel import open_parts
from shards.transport.s3_ranges import head_object, open_range
from shards.formats.sample import RawSample
from shards.formats.tarseek import iter_tar_stream

log = logging.getLogger("shardcache.tarindex")  # the logger a local missing sidecar is reported on

BLOCK = 1 << 20  # HDF5 block cache granularity (the writer's data chunks are 1 MiB)
MAX_READAHEAD = 32 << 20
CACHE_BYTES = 64 << 20  # per open S3File


# -- tar ------------------------------------------------------------------------------------------------------------
def load_index_by(open_stream: Callable[[str], ContextManager[Any]], location: str,
                  info: Any) -> np.ndarray | None:
    """The checked offsets of the tar shard at ``location`` (``info``: its ``ShardInfo``) on a location that reads
    byte ranges, its sidecar opened by ``open_stream(url)``; None without an index (none recorded, or the sidecar
    gone: the shard is then read by scanning, as a local one is). Read to at most one byte more than a correct
    sidecar holds, then held to the same checks as a local one (``shards.formats.tarindex.checked_index``)."""
    from shards.formats.tarindex import checked_index, index_size, sidecar_of

    if getattr(info, "index", None) is None:
        return None
    where = sidecar_of(location, info)
    try:
        with open_stream(where) as stream:
            data = stream.read(index_size(info) + 1)
    except MissingInputError:
        log.warning("%s: tar index missing; reading the shard by scanning its headers", where)
        return None
    return checked_index(data, where, info)


def load_s3_index(location: str, info: Any, options: S3Options) -> np.ndarray | None:
    """``load_index_by`` on S3."""
    return load_index_by(lambda where: open_range(where, 0, None, options), location, info)


def iter_s3_tar_slice(location: str, start: int, stop: int, options: S3Options, offsets: np.ndarray | None, *,
                      resync: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Samples ``start:stop`` of a tar shard on S3: one ranged GET with ``offsets``, else a stream from byte 0.
    ``resync``: damaged samples in place, as ``shards.formats.tarseek.iter_tar_slice`` yields them."""
    if offsets is None:
        with open_range(location, 0, None, options) as stream:
            samples = iter_tar_stream(io.BufferedReader(stream, 1 << 20), location, resync=resync)
            yield from itertools.islice(samples, start, stop)
        return
    first, last = tar_slice_range(offsets, start, stop)
    if first < last:
        with open_parts(location, first, last, options) as stream:
            yield from iter_tar_range(stream, location, start, stop, offsets, resync=resync)


def iter_tar_range(stream: Any, location: str, start: int, stop: int, offsets: np.ndarray, *,
                   resync: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Samples ``start:stop`` from ``stream``, the bytes ``tar_slice_range`` gives for them (any location that
    reads byte ranges: ``s3://``, ``http(s)`` that answers ranges). The range ends where sample ``stop`` starts:
    the parser meets the end of the bytes after the last sample."""
    stop = min(stop, len(offsets) - 1)
    samples = iter_tar_stream(io.BufferedReader(stream, 1 << 20), location, resync=resync, offsets=offsets,
                              first=start)
    yield from itertools.islice(samples, stop - start)


def tar_slice_range(offsets: np.ndarray, start: int, stop: int) -> tuple[int, int]:
    """The bytes ``[first, last)`` that samples ``start:stop`` of an indexed tar shard occupy (empty: none)."""
    stop = min(stop, len(offsets) - 1)
    if start >= stop:
        return 0, 0
    return int(offsets[start]), int(offsets[stop])


# -- HDF5 -----------------------------------------------------------------------------------------------------------
class S3File(io.RawIOBase):
    """A seekable, read-only view of one object for h5py: ``readinto`` is served from a block cache filled by
    ranged GETs (``BLOCK`` bytes; doubling read-ahead while reads stay sequential, up to ``MAX_READAHEAD``)."""

    def __init__(self, url: str, options: S3Options, size: int | None = None):
        super().__init__()
        self.url, self.options = url, options
        self.name = url
        self.size = head_object(url, options)[0] if size is None else size
        self.position = 0
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._next_miss = -1
        self._readahead = BLOCK

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def _fill(self, block: int) -> None:
        self._readahead = min(self._readahead * 2, MAX_READAHEAD) if block == self._next_miss else BLOCK
        first, last = block * BLOCK, min(self.size, block * BLOCK + self._readahead)
        opener = open_parts if last - first > parallel_parts.PART else open_range
        with opener(self.url, first, last, self.options) as stream:
            data = stream.read()
        if len(data) != last - first:
            raise CorruptDataError(f"short read at byte {first} ({len(data)} of {last - first} bytes)", path=self.url)
        for i in range(0, len(data), BLOCK):
            self._blocks[block + i // BLOCK] = data[i:i + BLOCK]
        self._next_miss = block + (len(data) + BLOCK - 1) // BLOCK
        while len(self._blocks) * BLOCK > CACHE_BYTES:
            self._blocks.popitem(last=False)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), max(0, self.size - self.position))
        done = 0
        while done < wanted:
            block, within = divmod(self.position, BLOCK)
            if block not in self._blocks:
                self._fill(block)
            self._blocks.move_to_end(block)
            data = self._blocks[block]
            n = min(wanted - done, len(data) - within)
            view[done:done + n] = data[within:within + n]
            done += n
            self.position += n
        return done


def indexed_span(storage: Any, start: int, stop: int, offsets: Any) -> tuple[int, int] | None:
    """The bytes samples ``start:stop`` occupy in a shard of an indexed format, None without an index or samples."""
    if not storage.indexed or offsets is None:
        return None
    if storage.load_index is not None:  # an adopted tar's rows (shards.formats.adopted)
        from shards.formats.adopted import row_span

        first, last = row_span(offsets, start, stop)
        return (first, last) if first < last else None
    first, last = tar_slice_range(offsets, start, stop)
    return (first, last) if first < last else None


def iter_s3_hdf5_slice(location: str, start: int, stop: int, options: S3Options, size: int, *,
                       resync: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Samples ``start:stop`` of an HDF5 shard on S3 (the local reader over an ``S3File``)."""
    from shards.formats.hdf5 import iter_hdf5_slice

    with S3File(location, options, size=size) as handle:
        yield from iter_hdf5_slice(handle, start, stop, resync=resync)
