"""The tar shard reader: members grouped into samples, seeking past the samples before a slice, and resyncing
after damage so one bad header costs one sample.

Headers are parsed strictly by ``shards.formats.tarheader``; this module seeks over the members of samples before
``start``, stops after ``stop``, and groups members into samples with webdataset's rule (the key is the name before
the first dot of its last path component).

Resync (``resync=True``, what the streaming reader asks for): a damaged sample is yielded as its
``CorruptDataError`` in its place, and reading goes on with the next sample, so rows stay aligned with the
manifest. With the per-sample byte index the damage is charged to the sample whose bytes hold it and the reader
jumps to the next sample's offset. Without one (an http stream, an older dataset) it scans forward block by block
to the next header whose checksum is right; the damage is charged to the sample in progress when the header names
it or the next member continues it (or it lacks its image or label), else to the sample that follows. Without
``resync`` the first damaged sample raises, after the good samples before it.

A local shard is opened through the one door (``shards.door.bounded_read.open_regular_file``): a FIFO, device, socket,
folder or link loop in its place is one ``CorruptDataError`` naming it (never a hang, a traceback or an endless
read of ``/dev/zero``), checked once per file, not per sample.
"""

from __future__ import annotations

import io
import os
from bisect import bisect_left, bisect_right
from typing import BinaryIO, Iterator, Sequence

from shards.door.bounded_read import open_regular_file
from shards.errors import CorruptDataError
from shards.formats.sample import IMAGE_EXTENSIONS, RawSample
from shards.formats.tarheader import (BLOCK, READ_BUFFER, REGULAR, ByteSource, header_name, is_header, read_member,
                                      split_member_name)


def _assemble(key: str, parts: dict[str, bytes], where: str) -> RawSample:
    try:
        label = int(parts["cls"])
    except (KeyError, ValueError) as exc:
        raise CorruptDataError("missing or malformed .cls member", path=where, key=key) from exc
    for ext in IMAGE_EXTENSIONS:
        if ext in parts:
            return RawSample(key, parts[ext], ext, label, parts.get("json", b""))
    raise CorruptDataError(f"no image member (found {sorted(parts)})", path=where, key=key)


# -- resync ---------------------------------------------------------------------------------------------------------
def _scan(source: ByteSource) -> None:
    """Move to the next block that reads as a header, or to the end: where reading resumes after damage when no
    index says where the next sample starts. Block by block, so a forged size cannot carry it past good samples."""
    source.padding = 0
    while len(block := source.read(BLOCK)) == BLOCK:
        if is_header(block):
            source.unread(block)
            return


def _key_before(source: ByteSource, limit: int) -> str | None:
    """The key named by the first header that reads as one between here and ``limit`` (the rest of a damaged
    sample, with an index): a damaged header's own name field cannot be trusted."""
    while source.offset + BLOCK <= limit and len(block := source.read(BLOCK)) == BLOCK:
        if is_header(block) and block[156:157] in REGULAR:
            try:
                return split_member_name(header_name(block))[0]
            except ValueError:
                continue
    return None


def _complete(exts: set[str]) -> bool:
    return "cls" in exts and any(ext in exts for ext in IMAGE_EXTENSIONS)


# -- grouping members into samples ----------------------------------------------------------------------------------
class _SampleReader:
    """One pass over a source: members grouped into samples ``start:stop`` (counted from the sample the source
    starts at, number ``first`` of the shard), each damaged sample a ``CorruptDataError`` in its place."""

    def __init__(self, source: ByteSource, start: int, stop: int | None, offsets: Sequence[int] | None, first: int):
        self.source, self.start, self.stop = source, start, stop
        self.offsets, self.first = offsets, first
        self.index = -1  # the current sample's position
        self.key: str | None = None  # the current sample's key (None: between samples)
        self.parts: dict[str, bytes] = {}
        self.exts: set[str] = set()
        self.damage: CorruptDataError | None = None  # damage charged to the current sample
        self.unplaced: CorruptDataError | None = None  # damage charged to the sample of the next member

    def _error(self, damage: CorruptDataError, key: str | None) -> CorruptDataError:
        return CorruptDataError(damage.reason, path=self.source.where, key=key)

    def _close(self) -> Iterator[RawSample | CorruptDataError]:
        """The current sample (if in ``start:stop``), then none."""
        key, self.key = self.key, None
        if key is None or self.index < self.start:
            return
        if self.damage is not None:
            yield self._error(self.damage, key)
            return
        try:
            sample: RawSample | CorruptDataError = _assemble(key, self.parts, self.source.where)
        except CorruptDataError as exc:
            sample = exc
        yield sample  # outside the try: a generator closed at interpreter exit never evaluates the except clause

    def _next_position(self) -> bool:
        """Count one more sample; False when it is past ``stop``."""
        self.index += 1
        return self.stop is None or self.index < self.stop

    def _charge(self, damage: CorruptDataError) -> None:
        """Without an index: charge damage to the sample in progress when it is named or cannot be whole without
        it, else to the sample of the next member (decided when the scan finds it)."""
        if self.key is not None and (damage.key == self.key or not _complete(self.exts)):
            self.damage = self.damage or damage
        else:
            self.unplaced = self.unplaced or damage

    def _jump(self, damage: CorruptDataError) -> Iterator[RawSample | CorruptDataError]:
        """With an index: charge damage to the sample whose bytes hold it and every sample read into, then seek to
        the next sample's offset. Returns False when reading should end."""
        offsets, samples = self.offsets, len(self.offsets) - 1
        hit = bisect_right(offsets, self.source.header_start) - 1
        resume = max(hit + 1, bisect_left(offsets, self.source.offset))
        if self.key is not None and self.first + self.index >= hit:
            self.damage = self.damage or damage
        yield from self._close()
        for number in range(self.first + self.index + 1, min(resume, samples)):
            if not self._next_position():
                return False
            if self.index >= self.start:
                key = _key_before(self.source, int(offsets[number + 1])) if number == hit else None
                yield self._error(damage, key) if key is not None else CorruptDataError(
                    f"{damage.reason}; sample {number} of the shard", path=self.source.where)
        if resume > samples:
            return False
        self.source.padding = 0
        self.source.skip(int(offsets[resume]) - self.source.offset)
        return True

    def samples(self) -> Iterator[RawSample | CorruptDataError]:
        source = self.source
        while True:
            try:
                member = read_member(source)
            except CorruptDataError as damage:
                if self.offsets is None:
                    self._charge(damage)
                    _scan(source)
                elif not (yield from self._jump(damage)):
                    return
                continue
            if member is None:
                break
            name, size = member
            member_key, ext = split_member_name(name)
            if member_key != self.key:
                yield from self._close()
                if not self._next_position():
                    return
                self.key, self.parts, self.exts = member_key, {}, set()
                self.damage, self.unplaced = self.unplaced, None
            elif self.unplaced is not None:  # the damage lay inside this sample
                self.damage, self.unplaced = self.damage or self.unplaced, None
            self.exts.add(ext.lower())
            if self.index < self.start:
                source.skip(size)
                continue
            try:
                self.parts[ext.lower()] = source.read(size, key=member_key)
            except CorruptDataError as damage:  # cut short: the end of the bytes follows
                self.damage = self.damage or damage
        yield from self._close()
        if self.unplaced is not None and self._next_position() and self.index >= self.start:
            yield self._error(self.unplaced, self.unplaced.key)  # damage after the last whole sample


def _first_error_raises(items: Iterator[RawSample | CorruptDataError]) -> Iterator[RawSample]:
    for item in items:
        if isinstance(item, CorruptDataError):
            raise item
        yield item


def iter_tar_slice(path: str | os.PathLike, start: int = 0, stop: int | None = None, *,
                   sha256: str | None = None, offsets: Sequence[int] | None = None,
                   resync: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Samples ``start:stop`` of a local tar shard; earlier samples are skipped by seeking, not read.

    ``offsets``: the shard's per-sample byte index (``shards.formats.tarindex.read_index``, already checked against
    the manifest): one seek to sample ``start`` instead of walking the headers before it, and the place to resume
    after a damaged sample. With ``sha256`` (a whole-shard read: ``start`` 0 and ``stop`` the shard's sample count
    or None), every byte is read and hashed on the way, and a ``ChecksumError`` follows the last sample when the
    digest differs. ``resync``: each damaged sample is yielded as its ``CorruptDataError`` and reading goes on;
    otherwise the first one raises.
    """
    items = _read_tar_slice(path, start, stop, sha256, offsets)
    return items if resync else _first_error_raises(items)


def open_tar(path: str | os.PathLike) -> io.BufferedReader:
    """A local tar opened for a sequential read with a large buffer, if it is a regular file; else
    ``CorruptDataError`` naming it (``MissingInputError``, a ``FileNotFoundError``, when there is none)."""
    checked = open_regular_file(path, error=CorruptDataError)
    return io.BufferedReader(checked.detach(), READ_BUFFER)


def _read_tar_slice(path: str | os.PathLike, start: int, stop: int | None, sha256: str | None,
                    offsets: Sequence[int] | None) -> Iterator[RawSample | CorruptDataError]:
    hashing = sha256 is not None and start == 0
    with open_tar(path) as handle:
        source = ByteSource(handle, str(path), total=os.fstat(handle.fileno()).st_size, hashing=hashing)
        first = 0
        if offsets is not None and start > 0 and not hashing:
            if start >= len(offsets) - 1:
                return
            handle.seek(int(offsets[start]))
            source.offset = int(offsets[start])
            first, start, stop = start, 0, None if stop is None else stop - start
        yield from _SampleReader(source, start, stop, offsets, first).samples()
        if hashing:
            source.check(sha256)


def tar_sample_offsets(path: str | os.PathLike) -> list[int]:
    """What a correct per-sample index of this local tar holds (``shards.formats.tarindex``), found by walking
    every header: where each sample's first header starts, then where the last sample's data ends."""
    offsets: list[int] = []
    with open_tar(path) as handle:
        source = ByteSource(handle, str(path), total=os.fstat(handle.fileno()).st_size, hashing=False)
        key = None
        while (member := read_member(source)) is not None:
            member_key = split_member_name(member[0])[0]
            if member_key != key:
                offsets.append(source.member_start)
                key = member_key
            source.skip(member[1])
        offsets.append(source.member_start)
    return offsets


def iter_tar_stream(stream: BinaryIO, where: str, *, resync: bool = False, offsets: Sequence[int] | None = None,
                    first: int = 0) -> Iterator[RawSample | CorruptDataError]:
    """Every sample of a tar stream (a file or a network response), in order, without seeking.

    A ranged read of samples ``first:`` of a shard with its byte index passes ``offsets`` and ``first``: byte
    offsets then name the shard's bytes, and a damaged sample is passed over to the next indexed offset.
    ``resync`` as in ``iter_tar_slice``.
    """
    start_at = 0 if offsets is None else int(offsets[first])
    source = ByteSource(stream, where, total=None, hashing=False, offset=start_at)
    items = _SampleReader(source, 0, None, offsets, first).samples()
    return items if resync else _first_error_raises(items)
