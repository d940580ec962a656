"""The tar shard reader: parses headers itself, strictly, and seeks past the samples before a slice.

``tarfile`` costs tens of microseconds per member, must read every byte to skip a member in stream mode, raises
raw ``ValueError``s on damaged headers and silently ends the archive at a bad header after the first. This reader
parses the 512-byte headers directly, seeks over the members of samples before ``start`` and stops after ``stop``.
It handles what tar writers produce for plain files: ustar names with a prefix, GNU long names, pax headers and
GNU base-256 sizes. Shard bytes are untrusted: every malformed header (bad checksum, non-octal field, size past the
end of the file, name that is not UTF-8, malformed pax record) or truncated member is a ``CorruptDataError`` naming
the shard and the sample key, or the byte offset of the header when no key can be read. A member's size is checked
against the bytes left in the file before anything is read, so a forged size never allocates memory; streams of
unknown length are read in bounded chunks. Members are grouped into samples with webdataset's rule (the key is the
name before the first dot of its last path component).
"""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO, Iterator, Sequence

from shards.errors import ChecksumError, CorruptDataError
from shards.formats.sample import IMAGE_EXTENSIONS, RawSample

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
REGULAR = (b"0", b"\0", b"7")
READ_BUFFER = 1 << 20
READ_CHUNK = 1 << 24  # largest single read from a stream of unknown length
MAX_EXTENDED_HEADER = 1 << 20  # pax and GNU long-name payloads: a name, not data


def _split_member_name(name: str) -> tuple[str, str]:
    # webdataset's rule: the key is everything before the first dot of the last path component.
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def _assemble(key: str, parts: dict[str, bytes], where: str) -> RawSample:
    try:
        label = int(parts["cls"])
    except (KeyError, ValueError) as exc:
        raise CorruptDataError("missing or malformed .cls member", path=where, key=key) from exc
    for ext in IMAGE_EXTENSIONS:
        if ext in parts:
            return RawSample(key, parts[ext], ext, label, parts.get("json", b""))
    raise CorruptDataError(f"no image member (found {sorted(parts)})", path=where, key=key)


# -- header fields --------------------------------------------------------------------------------------------------
def _octal(field: bytes, what: str) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # GNU base-256 (0xff: negative)
        value = int.from_bytes(field[1:], "big")
        if field[0] == 0xFF:
            raise ValueError(f"negative {what} field")
        return value
    digits = field.split(b"\0", 1)[0].strip(b" ")
    if digits.strip(b"01234567"):
        raise ValueError(f"{what} field {bytes(field)!r} is not octal")
    return int(digits or b"0", 8)


def _checksum_ok(header: bytes) -> bool:
    stored = _octal(header[148:156], "checksum")
    return stored == sum(header[:148]) + 8 * 32 + sum(header[156:])


def _text(field: bytes, what: str) -> str:
    try:
        return field.split(b"\0", 1)[0].decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not UTF-8: {bytes(field[:60])!r}") from None


def _header_name(header: bytes) -> str:
    name = _text(header[:100], "member name")
    if header[257:262] == b"ustar":
        prefix = _text(header[345:500], "member name prefix")
        if prefix:
            name = f"{prefix}/{name}"
    return name


def _guess_key(header: bytes) -> str | None:
    """The key a damaged header names, when its name field still reads as text (for the error message only)."""
    try:
        name = _header_name(header)
    except ValueError:
        return None
    return _split_member_name(name)[0] if name.isprintable() and name.strip() else None


def _pax_path(payload: bytes) -> str | None:
    """The ``path`` record of a pax extended header (``"<len> <key>=<value>\\n"`` records), if any."""
    path, pos = None, 0
    while pos < len(payload) and payload[pos]:  # NUL padding may follow the last record
        space = payload.find(b" ", pos, pos + 21)
        if space < 0 or not payload[pos:space].isdigit():
            raise ValueError(f"malformed pax record at payload byte {pos}")
        end = pos + int(payload[pos:space])
        if end <= space + 1 or end > len(payload) or payload[end - 1] != 0x0A or b"=" not in payload[space:end]:
            raise ValueError(f"malformed pax record at payload byte {pos}")
        keyword, _, value = payload[space + 1 : end - 1].partition(b"=")
        if keyword == b"path":
            path = _text(value, "pax path")
        pos = end
    return path


# -- the byte source ------------------------------------------------------------------------------------------------
class _Source:
    """A forward-only tar byte stream: tracks the offset, seeks over bytes it may skip, hashes when asked."""

    def __init__(self, handle: BinaryIO, where: str, *, total: int | None, hashing: bool):
        self.handle = handle
        self.where = where
        self.total = total  # file size, None for a stream of unknown length
        self.offset = 0
        self.member_start = 0
        self.digest = hashlib.sha256() if hashing else None
        self.can_seek = total is not None and not hashing

    def read(self, size: int, key: str | None = None) -> bytes:
        if size <= READ_CHUNK:
            data = self.handle.read(size)
        else:  # bounded by what the stream really holds, not by a size field
            chunks, left = [], size
            while left and (chunk := self.handle.read(min(left, READ_CHUNK))):
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
        if self.digest is not None:
            self.digest.update(data)
        self.offset += len(data)
        if len(data) < size and key is not None:
            raise CorruptDataError(f"truncated tar member at byte {self.offset} ({len(data)} of {size} bytes)",
                                   path=self.where, key=key)
        return data

    def skip(self, size: int) -> None:
        if self.can_seek:
            self.handle.seek(size, os.SEEK_CUR)
            self.offset += size
            return
        while size > 0:
            size -= len(self.read(min(size, READ_BUFFER))) or size

    def check(self, expected: str) -> None:
        """Read to the end of the file and compare the sha256 of every byte with ``expected``."""
        while self.read(READ_BUFFER):
            pass
        if self.digest is not None and self.digest.hexdigest() != expected:
            raise ChecksumError("sha256 of the shard does not match the manifest (corrupt or replaced)",
                                path=self.where)


def _members(source: _Source) -> Iterator[tuple[str, int]]:
    """Yield ``(name, size)`` of each regular member, leaving the source at its data. ``source.member_start`` is
    where the member's first header (a pax or GNU long-name header, if any) starts."""
    long_name: str | None = None
    while True:
        offset = source.offset
        if long_name is None:
            source.member_start = offset
        header = source.read(BLOCK)
        if len(header) < BLOCK or header == ZERO_BLOCK:
            if len(header) and header != ZERO_BLOCK:
                raise CorruptDataError(f"truncated tar header at byte {offset}", path=source.where)
            return
        try:
            if not _checksum_ok(header):
                raise ValueError("checksum mismatch")
            size = _octal(header[124:136], "size")
            kind = header[156:157]
            name = None if long_name is not None or kind not in REGULAR else _header_name(header)
        except ValueError as exc:
            raise CorruptDataError(f"bad tar header at byte {offset} ({exc})", path=source.where,
                                   key=_guess_key(header)) from None
        key = _split_member_name(long_name if name is None else name)[0] if kind in REGULAR else None
        left = None if source.total is None else source.total - source.offset
        if left is not None and size > left:
            raise CorruptDataError(f"tar header at byte {offset} gives a member size of {size} bytes, only {left} "
                                   "are left in the file", path=source.where, key=key)
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        if kind in (b"L", b"x"):
            if size > MAX_EXTENDED_HEADER:
                raise CorruptDataError(f"bad tar header at byte {offset} (extended header of {size} bytes)",
                                       path=source.where)
            payload = source.read(padded)[:size]
            try:
                long_name = _text(payload, "GNU long name") if kind == b"L" else _pax_path(payload)
            except ValueError as exc:
                raise CorruptDataError(f"bad tar header at byte {offset} ({exc})", path=source.where) from None
            continue
        if kind not in REGULAR:
            source.skip(padded)
            long_name = None
            continue
        if long_name is not None:
            name, long_name = long_name, None
        yield name, size
        source.skip(padded - size)


def _samples(source: _Source, start: int, stop: int | None) -> Iterator[RawSample]:
    where = source.where
    index = -1
    key = None
    parts: dict[str, bytes] = {}
    members = _members(source)
    while True:
        try:
            name, size = next(members)
        except StopIteration:
            break
        except CorruptDataError as exc:
            # A damaged header after a complete sample belongs to the next one: the sample read so far is good.
            if key is not None and index >= start and exc.key is not None and exc.key != key:
                yield _assemble(key, parts, where)
            raise
        member_key, ext = _split_member_name(name)
        if member_key != key:
            if index >= start and key is not None:
                yield _assemble(key, parts, where)
            parts = {}
            key = member_key
            index += 1
            if stop is not None and index >= stop:
                return
        if index < start:
            source.skip(size)
            continue
        parts[ext.lower()] = source.read(size, key=member_key)
    if key is not None and index >= start:
        yield _assemble(key, parts, where)


def iter_tar_slice(path: str | os.PathLike, start: int = 0, stop: int | None = None, *,
                   sha256: str | None = None, offsets: Sequence[int] | None = None) -> Iterator[RawSample]:
    """Samples ``start:stop`` of a local tar shard; earlier samples are skipped by seeking, not read.

    ``offsets``: the shard's per-sample byte index (``shards.formats.tarindex.read_index``, already checked against
    the manifest): one seek to sample ``start`` instead of walking the headers before it.
    With ``sha256`` (a whole-shard read: ``start`` 0 and ``stop`` the shard's sample count or None), every byte is
    read and hashed on the way, and a ``ChecksumError`` follows the last sample when the digest differs.
    """
    hashing = sha256 is not None and start == 0
    with open(path, "rb", buffering=READ_BUFFER) as handle:
        source = _Source(handle, str(path), total=os.fstat(handle.fileno()).st_size, hashing=hashing)
        if offsets is not None and start > 0 and not hashing:
            if start >= len(offsets) - 1:
                return
            handle.seek(int(offsets[start]))
            source.offset = int(offsets[start])
            stop = None if stop is None else stop - start
            start = 0
        yield from _samples(source, start, stop)
        if hashing:
            source.check(sha256)


def tar_sample_offsets(path: str | os.PathLike) -> list[int]:
    """What a correct per-sample index of this local tar holds (``shards.formats.tarindex``), found by walking
    every header: where each sample's first header starts, then where the last sample's data ends."""
    offsets: list[int] = []
    with open(path, "rb", buffering=READ_BUFFER) as handle:
        source = _Source(handle, str(path), total=os.fstat(handle.fileno()).st_size, hashing=False)
        key = None
        for name, size in _members(source):
            member_key = _split_member_name(name)[0]
            if member_key != key:
                offsets.append(source.member_start)
                key = member_key
            source.skip(size)
        offsets.append(source.member_start)
    return offsets


def iter_tar_stream(stream: BinaryIO, where: str) -> Iterator[RawSample]:
    """Every sample of a tar stream (a file or a network response), in order, without seeking."""
    yield from _samples(_Source(stream, where, total=None, hashing=False), 0, None)
