"""Parallel ranged reads on S3: ``shards.transport.parallel_parts`` with each part one ``open_range``
(``shards.transport.s3_ranges``), so every part keeps the retries, the backoff, the mid-body resume and the typed
errors of a single ranged read, and ``FETCH_STATS`` counts every byte and request once.

- ``open_parts``: bytes ``[start, stop)`` of an object (a tar slice by its byte index, an HDF5 read-ahead); a
  stream opened ahead for the same range (``read_ahead``) is taken instead of fetching again.
- ``open_whole``: a whole object of unknown size (feature shards, ``shards verify``, the node cache's fetch, a
  manifest): one first GET of ``FIRST_PART`` bytes says the size, the rest comes in parallel parts.
- ``open_sized``: a whole object whose size the manifest gives (``fetch_checked``): every part at once, or the
  stream ``read_ahead_sized`` opened for it.
- ``read_ahead``: open ``[start, stop)`` now, within ``S3Options.read_ahead_bytes``, for a later ``open_parts``.

Requests in flight per process: ``S3Options.max_concurrency`` (the pool's threads; a DataLoader worker has its own).
"""

from __future__ import annotations

import io
from typing import BinaryIO

from shards.errors import ChecksumError
from shards.transport import parallel_parts
from shards.transport.parallel_parts import PartStream, pool_for
from shards.transport.s3 import S3Options
from shards.transport.s3_ranges import RangeReader, open_range


def _fetcher(url: str, options: S3Options, object_size: int | None = None):
    """``fetch(start, stop)`` by one ``open_range``; with ``object_size``, a response saying the object has
    another size is a ``ChecksumError`` (a longer object; a shorter one fails in ``open_range``)."""
    def fetch(start: int, stop: int) -> bytes:
        with open_range(url, start, stop, options) as stream:
            data = stream.read()
            if object_size is not None and stream.size is not None and stream.size != object_size:
                raise ChecksumError(f"{stream.size} bytes, the manifest records {object_size} (truncated or "
                                    "replaced)", path=url)
            return data

    return fetch


def open_parts(url: str, start: int, stop: int, options: S3Options) -> PartStream:
    """A stream of exactly bytes ``[start, stop)`` of ``url`` (an object shorter than ``stop`` is a
    ``CorruptDataError``), fetched in parallel parts; the one ``read_ahead`` opened, when there is one."""
    return parallel_parts.open_range(_fetcher(url, options), url, start, stop, options.max_concurrency)


def read_ahead(url: str, start: int, stop: int, options: S3Options) -> bool:
    """Start fetching ``[start, stop)`` for a later ``open_parts``; False when ``read_ahead_bytes`` has no room."""
    return parallel_parts.read_ahead(_fetcher(url, options), url, start, stop, options.max_concurrency,
                                     options.read_ahead_bytes)


def open_whole(url: str, options: S3Options) -> BinaryIO:
    """The whole object as one stream: the first ``FIRST_PART`` bytes (their response says the size), then the
    rest in parallel parts."""
    first_part = parallel_parts.FIRST_PART
    with RangeReader(url, 0, None, options, chunk=first_part) as first:
        head = first.read(first_part)
        size = first.size
    if size is None or size <= len(head):
        return io.BufferedReader(io.BytesIO(head))
    return io.BufferedReader(PartStream(_fetcher(url, options), url, len(head), size,
                                        pool_for(options.max_concurrency), head=head), 1 << 20)


def open_sized(url: str, size: int, options: S3Options) -> BinaryIO:
    """The whole object the manifest says is ``size`` bytes, every part requested at once (no first request to
    learn the size), or the stream ``read_ahead_sized`` opened for it; a part whose response gives another size is
    a ``ChecksumError``."""
    if size <= 0:
        return open_whole(url, options)
    return io.BufferedReader(parallel_parts.open_range(_fetcher(url, options, size), url, 0, size,
                                                       options.max_concurrency), 1 << 20)


def read_ahead_sized(url: str, size: int, options: S3Options) -> bool:
    """Start fetching the whole ``size``-byte object for a later ``open_sized`` (the next feature shards of a
    loader, so consecutive whole objects overlap instead of paying a round trip each); False when
    ``read_ahead_bytes`` has no room."""
    if size <= 0:
        return True
    return parallel_parts.read_ahead(_fetcher(url, options, size), url, 0, size, options.max_concurrency,
                                     options.read_ahead_bytes)
