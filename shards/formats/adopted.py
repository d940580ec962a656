"""Adopted WebDataset tars: the row index that lets shardcache read tars it did not write, and the reader over it.

A tar someone else wrote (``webdataset.TarWriter``, img2dataset, GNU tar) may hold samples our strict parser
refuses (no image, a bad key, one extension twice), members in any order, extra members, and labels that are not
our numbering (a ``.cls`` of ``"7"`` is the class named ``7``, whose index is its place among the sorted class
names). So ``shards index`` (``preprocess.adopt``) records, per tar, one row per sample it accepted: the byte where
the sample's first header starts, the byte where its last member's data ends, and its label. The reader reads
exactly those rows, never a refused sample between them, and takes each label from the row, never from the tar.
The row index lives under the index folder, never beside the tar (the tars are not ours to write next to).

Layout ``<shard>.rows`` (little-endian): 8-byte magic ``b"SCROWS\\0\\1"``, ``uint64`` count N, then N rows of three
``uint64``: start, end, label. Untrusted like every byte shardcache reads: ``checked_rows`` checks the size its
count implies, the manifest's sha256, the magic, that rows do not overlap, rise, and end inside the shard; any
failure is a ``CorruptDataError`` naming the file.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np

from shards.errors import ChecksumError, CorruptDataError
from shards.formats.sample import IMAGE_EXTENSIONS, RawSample
from shards.formats.tarheader import ByteSource, read_member, split_member_name
from shards.formats.tarseek import open_tar

ROWS_SUFFIX = ".rows"
MAGIC = b"SCROWS\0\1"
_HEADER = len(MAGIC) + 8
_ROW = np.dtype("<u8")
_WANTED = frozenset({"json", *IMAGE_EXTENSIONS})  # members the reader keeps; others are passed over by a seek


def rows_name(shard_name: str) -> str:
    """``part/shard-000.tar`` -> ``part/shard-000.tar.rows``: its row index's name under the index folder."""
    return shard_name + ROWS_SUFFIX


def rows_bytes(rows: Sequence[tuple[int, int, int]]) -> bytes:
    """The row index's bytes for ``rows`` (start, end, label per accepted sample, in tar order)."""
    table = np.asarray(rows, dtype=_ROW).reshape(-1, 3)
    return MAGIC + np.uint64(len(table)).astype("<u8").tobytes() + table.tobytes()


def rows_size(samples: int) -> int:
    return _HEADER + samples * 3 * _ROW.itemsize


def checked_rows(data: bytes, where: str, info: Any) -> np.ndarray:
    """The ``[N, 3]`` rows in ``data`` (read from ``where``) for the shard ``info`` describes (its ``ShardInfo``),
    held to its size, the manifest's ``index_sha256`` and the layout; else ``CorruptDataError``/``ChecksumError``."""
    expected = rows_size(info.samples)
    if len(data) != expected:
        raise CorruptDataError(f"bad row index ({len(data)} bytes, expected {expected} for {info.samples} samples)",
                               path=where)
    if info.index_sha256 is not None and hashlib.sha256(data).hexdigest() != info.index_sha256:
        raise ChecksumError("sha256 of the row index does not match the manifest", path=where)
    if data[:len(MAGIC)] != MAGIC or int(np.frombuffer(data, "<u8", 1, len(MAGIC))[0]) != info.samples:
        raise CorruptDataError("not a row index of this version, or its count is not the manifest's", path=where)
    rows = np.frombuffer(data, _ROW, offset=_HEADER).reshape(-1, 3)
    starts, ends = rows[:, 0], rows[:, 1]
    if len(rows) and (np.any(ends <= starts) or np.any(starts[1:] < ends[:-1]) or int(ends[-1]) > info.bytes):
        raise CorruptDataError("rows overlap, go backwards or end past the shard", path=where)
    return rows


def load_rows(root: Any, info: Any, *, where: str | None = None) -> np.ndarray:
    """The checked rows of the shard ``info`` describes, read from the index folder ``root`` (a location:
    ``shards.transport.location``), under the one name its shard implies, confined there like every name a manifest
    gives; a missing file is ``MissingInputError``."""
    if info.index != rows_name(info.path):
        raise CorruptDataError(f"the manifest names row index {info.index!r} for shard {info.path!r}; expected "
                               f"{rows_name(info.path)!r}", path=where or str(root))
    sidecar = root.child(info.index, where=where, what="row index")
    with sidecar.open() as stream:  # a file swapped for a larger one is read one byte past its size, no further
        data = stream.read(rows_size(info.samples) + 1)
    return checked_rows(data, sidecar.text, info)


def _sample(source: ByteSource, end: int, label: int) -> RawSample:
    """The sample whose members fill the source from here to ``end``: its image and ``.json`` members kept, the
    others passed over. Anything else there (another key, a member running past ``end``) means the tar is not the
    one indexed."""
    key: str | None = None
    parts: dict[str, bytes] = {}
    while source.offset + source.padding < end:
        member = read_member(source)
        if member is None:
            break
        name, size = member
        member_key, ext = split_member_name(name)
        key = member_key if key is None else key
        if member_key != key or source.offset + size > end:
            raise CorruptDataError("the tar no longer holds the sample indexed here (changed since it was indexed?)",
                                   path=source.where, key=key)
        if ext.lower() in _WANTED and ext.lower() not in parts:
            parts[ext.lower()] = source.read(size, key=key)
        else:
            source.skip(size)
    image = next((ext for ext in IMAGE_EXTENSIONS if ext in parts), None)
    if key is None or image is None:
        raise CorruptDataError("no image member where the row index says a sample is (changed since it was indexed?)",
                               path=source.where, key=key)
    return RawSample(key, parts[image], image, label, parts.get("json", b""))


def iter_rows(source: ByteSource, rows: np.ndarray, start: int, stop: int, *,
              resync: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Rows ``start:stop`` from a forward-only ``source`` positioned at or before row ``start``'s first byte (a
    ranged read of their span, or a whole file); damage costs its own row (``resync``) or raises."""
    for number in range(start, min(stop, len(rows))):
        begin, end, label = (int(v) for v in rows[number])
        try:
            if source.offset > begin:
                raise CorruptDataError("the damage before this sample ran into it", path=source.where)
            source.padding = 0
            source.skip(begin - source.offset)
            yield _sample(source, end, label)
        except CorruptDataError as exc:
            if not resync:
                raise
            yield exc


def iter_adopted_slice(path: str | os.PathLike, start: int = 0, stop: int | None = None, *,
                       sha256: str | None = None, offsets: np.ndarray | None = None,
                       resync: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Rows ``start:stop`` of a local adopted tar (``offsets``: its checked rows, required). Each row is reached by
    one seek; with ``sha256`` (a whole-shard read) every byte is read, hashed and checked after the last row."""
    if offsets is None:
        raise CorruptDataError("an adopted tar is read by its row index, and none was loaded", path=str(path))
    stop = len(offsets) if stop is None else stop
    hashing = sha256 is not None and start == 0 and stop >= len(offsets)
    with open_tar(path) as handle:
        total = os.fstat(handle.fileno()).st_size
        if hashing:
            source = ByteSource(handle, str(path), total=total, hashing=True)
            yield from iter_rows(source, offsets, start, stop, resync=resync)
            source.check(sha256)
            return
        number, last = start, min(stop, len(offsets))
        while number < last:  # one source over the rows, the gaps between them skipped by seeking
            begin = int(offsets[number, 0])
            handle.seek(begin)
            source = ByteSource(handle, str(path), total=total, hashing=False, offset=begin)
            for item in iter_rows(source, offsets, number, last, resync=resync):
                number += 1
                yield item
                if isinstance(item, CorruptDataError):
                    break  # a fresh source from the next row: damage in one row never shifts the next


def iter_adopted_stream(stream: BinaryIO, where: str, rows: np.ndarray, start: int, stop: int, *,
                        resync: bool = False, from_start: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Rows ``start:stop`` from ``stream``: the shard's bytes from row ``start``'s first byte on (``row_span``), or
    from its first byte (``from_start``: a server that answers no ranges), the bytes before each row passed over."""
    if start >= min(stop, len(rows)):
        return iter(())
    source = ByteSource(stream, where, total=None, hashing=False, offset=0 if from_start else int(rows[start, 0]))
    return iter_rows(source, rows, start, stop, resync=resync)


def row_span(rows: np.ndarray, start: int, stop: int) -> tuple[int, int]:
    """The bytes ``[first, last)`` that rows ``start:stop`` span (refused samples between them included)."""
    stop = min(stop, len(rows))
    if start >= stop:
        return 0, 0
    return int(rows[start, 0]), int(rows[stop - 1, 1])


def no_stream_read(*args: Any, **kwargs: Any) -> Iterator[RawSample]:
    """An adopted tar holds samples its row index leaves out: it is never read as a plain stream."""
    raise CorruptDataError("an adopted tar is read by its row index, not as a plain stream")


__all__ = ["MAGIC", "ROWS_SUFFIX", "checked_rows", "iter_adopted_slice", "iter_adopted_stream", "iter_rows",
           "load_rows", "row_span", "rows_bytes", "rows_name", "rows_size"]
