"""Adopted WebDataset tars: the row index that lets shardcache read tars it did not write, and the reader over it.

A tar someone else wrote (``webdataset.TarWriter``, img2dataset, GNU tar) may hold samples our strict parser
refuses (no image, a bad key, one extension twice), members in any order, extra members, and labels that are not
our numbering (a ``.cls`` of ``"7"`` is the class named ``7``, whose index is its place among the sorted class
names). So ``shards index`` (``preprocess.adopt``) records, per tar, one row per sample it accepted: the byte where
the sample's first header starts, the byte where its last member's data ends, its label, its key and a checksum
of the bytes the reader keeps of it. The reader reads exactly those rows, never a refused sample between them, and
takes each label from the row, never from the tar.
The row index lives under the index folder, never beside the tar (the tars are not ours to write next to).

The label is detached from the bytes, and the tars are files other people keep writing: a same-layout change
(two equal-sized images swapped, a tar replaced by another of its size) would pair an image with another's label.
So before a row's label is attached, the reader compares the key it meets with the row's key and the CRC-32 of
the members it keeps (``row_checksum``: each kept member's extension and bytes, in tar order) with the row's; a
mismatch is a ``CorruptDataError`` naming the tar, row and key, which costs that sample under the error policy.
A read whose first ``CHANGED_RUN`` rows all disagree names the tar as changed since it was indexed
(docs/trust-model.md, "Adopted datasets").

Layout ``<shard>.rows`` (little-endian): 8-byte magic ``b"SCROWS\\0\\2"``, ``uint64`` count N, ``uint64`` K (the
keys' bytes), N rows of five ``uint64`` (start, end, label, CRC-32, end of the row's key in the keys), then the K
bytes of the keys (UTF-8, in row order). Untrusted like every byte shardcache reads: ``checked_rows`` checks the
size the header implies (K at most ``MAX_KEY_BYTES`` per row), the manifest's sha256, the magic, that rows do not
overlap, rise, and end inside the shard, and that the keys' ends rise to K; any failure is a ``CorruptDataError``
naming the file.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator, NamedTuple, Sequence

import numpy as np

from shards.errors import ChecksumError, CorruptDataError
from shards.formats.sample import IMAGE_EXTENSIONS, RawSample
from shards.formats.tarheader import ByteSource, read_member, split_member_name
from shards.formats.tarseek import open_tar

ROWS_SUFFIX = ".rows"
MAGIC = b"SCROWS\0\2"
_HEADER = len(MAGIC) + 16
_ROW = np.dtype("<u8")
_COLUMNS = 5  # start, end, label, checksum, end of the key
MAX_KEY_BYTES = 256  # a key the scan accepts fits a ustar name (100 bytes); the keys' bound against the manifest
CHANGED_RUN = 3  # rows read, all disagreeing, after which a read names the whole tar as changed
_WANTED = frozenset({"json", *IMAGE_EXTENSIONS})  # members the reader keeps; others are passed over by a seek


class IndexedRow(NamedTuple):
    """One accepted sample as the index records it."""

    start: int
    end: int
    label: int
    checksum: int
    key: str


@dataclass(frozen=True)
class RowIndex:
    """A tar's checked rows: ``table`` ``[N, 5]`` (start, end, label, checksum, key end) and the keys' bytes."""

    table: np.ndarray
    keys: bytes

    def __len__(self) -> int:
        return len(self.table)

    def key(self, number: int) -> str:
        first = int(self.table[number - 1, 4]) if number else 0
        return self.keys[first:int(self.table[number, 4])].decode("utf-8", "replace")


def rows_name(shard_name: str) -> str:
    """``part/shard-000.tar`` -> ``part/shard-000.tar.rows``: its row index's name under the index folder."""
    return shard_name + ROWS_SUFFIX


def rows_bytes(rows: Sequence[IndexedRow]) -> bytes:
    """The row index's bytes for ``rows`` (one per accepted sample, in tar order)."""
    keys = [row.key.encode("utf-8") for row in rows]
    ends = np.cumsum([len(key) for key in keys], dtype=np.int64)
    table = np.zeros((len(rows), _COLUMNS), dtype=_ROW)
    if rows:
        table[:, :4] = np.asarray([row[:4] for row in rows], dtype=_ROW)
        table[:, 4] = ends
    blob = b"".join(keys)
    return MAGIC + np.asarray([len(rows), len(blob)], "<u8").tobytes() + table.tobytes() + blob


def rows_size(samples: int) -> int:
    """The bytes of a row index of ``samples`` rows, its keys left out."""
    return _HEADER + samples * _COLUMNS * _ROW.itemsize


def _key_bytes(header: bytes, samples: int) -> int:
    """The keys' size a row index's header gives, held to ``MAX_KEY_BYTES`` per row (more is read only to fail)."""
    if len(header) < _HEADER:
        return 0
    return min(int(np.frombuffer(header, "<u8", 1, len(MAGIC) + 8)[0]), samples * MAX_KEY_BYTES + 1)


def checked_rows(data: bytes, where: str, info: Any) -> RowIndex:
    """The rows in ``data`` (read from ``where``) for the shard ``info`` describes (its ``ShardInfo``), held to the
    size its header implies, the manifest's ``index_sha256`` and the layout; else
    ``CorruptDataError``/``ChecksumError``."""
    keys = _key_bytes(data[:_HEADER], info.samples)
    expected = rows_size(info.samples) + keys
    if len(data) != expected or keys > info.samples * MAX_KEY_BYTES:
        raise CorruptDataError(f"bad row index ({len(data)} bytes, expected {expected} for {info.samples} samples "
                               f"and {keys} bytes of keys)", path=where)
    if info.index_sha256 is not None and hashlib.sha256(data).hexdigest() != info.index_sha256:
        raise ChecksumError("sha256 of the row index does not match the manifest", path=where)
    if data[:len(MAGIC)] != MAGIC or int(np.frombuffer(data, "<u8", 1, len(MAGIC))[0]) != info.samples:
        raise CorruptDataError("not a row index of this version, or its count is not the manifest's", path=where)
    table = np.frombuffer(data, _ROW, info.samples * _COLUMNS, _HEADER).reshape(-1, _COLUMNS)
    starts, ends, key_ends = table[:, 0], table[:, 1], table[:, 4]
    if len(table) and (np.any(ends <= starts) or np.any(starts[1:] < ends[:-1]) or int(ends[-1]) > info.bytes):
        raise CorruptDataError("rows overlap, go backwards or end past the shard", path=where)
    if len(table) and (int(key_ends[0]) == 0 or np.any(key_ends[1:] <= key_ends[:-1]) or int(key_ends[-1]) != keys):
        raise CorruptDataError("the rows' keys are empty, go backwards or do not fill the keys", path=where)
    return RowIndex(table, data[rows_size(info.samples):])


def load_rows(root: Any, info: Any, *, where: str | None = None) -> RowIndex:
    """The checked rows of the shard ``info`` describes, read from the index folder ``root`` (a location:
    ``shards.transport.location``), under the one name its shard implies, confined there like every name a manifest
    gives; a missing file is ``MissingInputError``."""
    if info.index != rows_name(info.path):
        raise CorruptDataError(f"the manifest names row index {info.index!r} for shard {info.path!r}; expected "
                               f"{rows_name(info.path)!r}", path=where or str(root))
    sidecar = root.child(info.index, where=where, what="row index")
    with sidecar.open() as stream:  # a file swapped for a larger one is read one byte past its size, no further
        header = stream.read(_HEADER)
        data = header + stream.read(rows_size(info.samples) - _HEADER + _key_bytes(header, info.samples) + 1)
    return checked_rows(data, sidecar.text, info)


def read_row(source: ByteSource, end: int) -> tuple[str | None, dict[str, bytes], int]:
    """The members filling ``source`` from here to ``end``: their key, the kept ones (the first member of each
    image or ``.json`` extension; the others are passed over) and ``row_checksum`` of them. The one definition
    the scan records and the reader checks. A member of another key, or one running past ``end``, means the tar
    is not the one indexed."""
    key: str | None = None
    parts: dict[str, bytes] = {}
    checksum = 0
    while source.offset + source.padding < end:
        member = read_member(source)
        if member is None:
            break
        name, size = member
        member_key, ext = split_member_name(name)
        key = member_key if key is None else key
        if member_key != key or source.offset + size > end:
            raise CorruptDataError("members of another sample, or running past its end, where the index has one "
                                   "sample: the tar changed since it was indexed?", path=source.where, key=key)
        ext = ext.lower()
        if ext in _WANTED and ext not in parts:
            parts[ext] = source.read(size, key=key)
            checksum = row_checksum(ext, parts[ext], checksum)
        else:
            source.skip(size)
    return key, parts, checksum


def row_checksum(ext: str, data: bytes, checksum: int = 0) -> int:
    """The running CRC-32 of a row's kept members, each its extension, a NUL and its bytes (a member that moved to
    another extension changes it too). CRC-32, not a cryptographic hash: it guards against a tar that changed
    under the index, not against one forged to match (docs/trust-model.md)."""
    return zlib.crc32(data, zlib.crc32(ext.encode("ascii") + b"\0", checksum))


def _sample(source: ByteSource, rows: RowIndex, number: int) -> RawSample:
    """Row ``number``, the source at its first byte: its key and checksum compared with the index's before its
    label is attached."""
    _, end, label, checksum = (int(v) for v in rows.table[number, :4])
    indexed = rows.key(number)
    try:
        key, parts, found = read_row(source, end)
    except CorruptDataError as exc:
        raise CorruptDataError(f"row {number}: {exc.reason}", path=source.where, key=indexed) from None
    if key != indexed:
        raise CorruptDataError(f"row {number} holds sample {key!r:.80}, not the one indexed: the tar changed since "
                               "it was indexed?", path=source.where, key=indexed)
    if found != checksum:
        raise CorruptDataError(f"row {number}: its bytes are not the ones indexed (CRC-32 {found:08x}, indexed "
                               f"{checksum:08x}): the tar changed since it was indexed?", path=source.where,
                               key=indexed)
    image = next((ext for ext in IMAGE_EXTENSIONS if ext in parts), None)
    if image is None:
        raise CorruptDataError(f"row {number}: no image member where the index has a sample: the tar changed since "
                               "it was indexed?", path=source.where, key=indexed)
    return RawSample(indexed, parts[image], image, label, parts.get("json", b""))


class Agreement:
    """Whether a read has met a row that matches the index: until one does, each failed row counts, and when the
    first ``CHANGED_RUN`` rows read (or all of a shorter read) failed, the tar is named as changed."""

    def __init__(self, rows: int):
        self.run = max(1, min(CHANGED_RUN, rows))
        self.matched, self.failed = False, 0

    def changed(self, exc: CorruptDataError) -> CorruptDataError | None:
        if self.matched:
            return None
        self.failed += 1
        if self.failed < self.run:
            return None
        return CorruptDataError(f"changed since it was indexed: the first {self.failed} rows read are not the "
                                f"samples the index records ({exc.reason}); index it again (shards index into a "
                                "new --out)", path=exc.path, key=exc.key)


def iter_rows(source: ByteSource, rows: RowIndex, start: int, stop: int, *, resync: bool = False,
              agreement: Agreement | None = None) -> Iterator[RawSample | CorruptDataError]:
    """Rows ``start:stop`` from a forward-only ``source`` positioned at or before row ``start``'s first byte (a
    ranged read of their span, or a whole file); damage costs its own row (``resync``) or raises; a read whose
    first rows all fail raises, naming the tar as changed (``agreement``: shared by the caller's reads)."""
    stop = min(stop, len(rows))
    agreement = agreement or Agreement(stop - start)
    for number in range(start, stop):
        begin = int(rows.table[number, 0])
        try:
            if source.offset > begin:
                raise CorruptDataError(f"row {number}: the damage before this sample ran into it",
                                       path=source.where, key=rows.key(number))
            source.padding = 0
            source.skip(begin - source.offset)
            sample = _sample(source, rows, number)
        except CorruptDataError as exc:
            changed = agreement.changed(exc)
            if changed is not None:
                raise changed from None
            if not resync:
                raise
            yield exc
            continue
        agreement.matched = True
        yield sample


def iter_adopted_slice(path: str | os.PathLike, start: int = 0, stop: int | None = None, *,
                       sha256: str | None = None, offsets: RowIndex | None = None,
                       resync: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Rows ``start:stop`` of a local adopted tar (``offsets``: its checked rows, required). Each row is reached by
    one seek; with ``sha256`` (a whole-shard read) every byte is read, hashed and checked after the last row."""
    if offsets is None:
        raise CorruptDataError("an adopted tar is read by its row index, and none was loaded", path=str(path))
    stop = len(offsets) if stop is None else stop
    hashing = sha256 is not None and start == 0 and stop >= len(offsets)
    agreement = Agreement(min(stop, len(offsets)) - start)
    with open_tar(path) as handle:
        total = os.fstat(handle.fileno()).st_size
        if hashing:
            source = ByteSource(handle, str(path), total=total, hashing=True)
            yield from iter_rows(source, offsets, start, stop, resync=resync, agreement=agreement)
            source.check(sha256)
            return
        number, last = start, min(stop, len(offsets))
        while number < last:  # one source over the rows, the gaps between them skipped by seeking
            begin = int(offsets.table[number, 0])
            handle.seek(begin)
            source = ByteSource(handle, str(path), total=total, hashing=False, offset=begin)
            for item in iter_rows(source, offsets, number, last, resync=resync, agreement=agreement):
                number += 1
                yield item
                if isinstance(item, CorruptDataError):
                    break  # a fresh source from the next row: damage in one row never shifts the next


def iter_adopted_stream(stream: BinaryIO, where: str, rows: RowIndex, start: int, stop: int, *,
                        resync: bool = False, from_start: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Rows ``start:stop`` from ``stream``: the shard's bytes from row ``start``'s first byte on (``row_span``), or
    from its first byte (``from_start``: a server that answers no ranges), the bytes before each row passed over."""
    if start >= min(stop, len(rows)):
        return iter(())
    offset = 0 if from_start else int(rows.table[start, 0])
    source = ByteSource(stream, where, total=None, hashing=False, offset=offset)
    return iter_rows(source, rows, start, stop, resync=resync)


def row_span(rows: RowIndex, start: int, stop: int) -> tuple[int, int]:
    """The bytes ``[first, last)`` that rows ``start:stop`` span (refused samples between them included)."""
    stop = min(stop, len(rows))
    if start >= stop:
        return 0, 0
    return int(rows.table[start, 0]), int(rows.table[stop - 1, 1])


def no_stream_read(*args: Any, **kwargs: Any) -> Iterator[RawSample]:
    """An adopted tar holds samples its row index leaves out: it is never read as a plain stream."""
    raise CorruptDataError("an adopted tar is read by its row index, not as a plain stream")


__all__ = ["CHANGED_RUN", "MAGIC", "MAX_KEY_BYTES", "ROWS_SUFFIX", "Agreement", "IndexedRow", "RowIndex",
           "checked_rows", "iter_adopted_slice", "iter_adopted_stream", "iter_rows", "load_rows", "read_row",
           "row_checksum", "row_span", "rows_bytes", "rows_name", "rows_size"]
