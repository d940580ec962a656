"""Tar headers read one member at a time from untrusted bytes: strict fields, a forward-only byte source.

``tarfile`` costs tens of microseconds per member, must read every byte to skip a member in stream mode, raises
raw ``ValueError``s on damaged headers and silently ends the archive at a bad header after the first. This parser
reads the 512-byte headers directly. It handles what tar writers produce for plain files: ustar names with a
prefix, GNU long names, pax headers and GNU base-256 sizes. Every malformed header (bad checksum, non-octal field,
size past the end of the file, name that is not UTF-8, malformed pax record, a zeroed header with data after it)
or truncated member is a ``CorruptDataError`` naming the shard and the sample key, or the byte offset of the
header when no key can be read. A member's size is checked against the bytes left in the file before anything is
read, so a forged size never allocates memory; streams of unknown length are read in bounded chunks. Grouping
members into samples, and resyncing after damage, is ``shards.formats.tarseek``'s.

A pax ``path`` or ``size`` record overrides the ustar field of the member it precedes, as in ``tarfile`` and GNU
tar: a member of 8 GiB or more has its size only there (``tarfile`` writes 0 in the ustar field), and a reader
that believed the ustar field would read the member's data as headers, or see other members than every other tar
reader does. When several extended headers precede one member, the first to set a field wins (``tarfile``'s rule).
"""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO

from shards.errors import ChecksumError, CorruptDataError

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
REGULAR = (b"0", b"\0", b"7")
READ_BUFFER = 1 << 20
READ_CHUNK = 1 << 24  # largest single read from a stream of unknown length
MAX_EXTENDED_HEADER = 1 << 20  # pax and GNU long-name payloads: a name, not data


def split_member_name(name: str) -> tuple[str, str]:
    # webdataset's rule: the key is everything before the first dot of the last path component.
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


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


def is_header(block: bytes) -> bool:
    """Whether a block reads as a tar header (its checksum is right): where a scan after damage resumes."""
    try:
        return block != ZERO_BLOCK and _checksum_ok(block)
    except ValueError:
        return False


def _text(field: bytes, what: str) -> str:
    try:
        return field.split(b"\0", 1)[0].decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not UTF-8: {bytes(field[:60])!r}") from None


def header_name(header: bytes) -> str:
    name = _text(header[:100], "member name")
    if header[257:262] == b"ustar":
        prefix = _text(header[345:500], "member name prefix")
        if prefix:
            name = f"{prefix}/{name}"
    return name


def _guess_key(header: bytes) -> str | None:
    """The key a damaged header names, when its name field still reads as text (for the error message only)."""
    try:
        name = header_name(header)
    except ValueError:
        return None
    return split_member_name(name)[0] if name.isprintable() and name.strip() else None


MAX_SIZE_DIGITS = 20  # a pax size record: 10**20 bytes is past any file, and int() of it is cheap


def _pax_records(payload: bytes) -> tuple[str | None, int | None]:
    """The ``path`` and ``size`` records of a pax extended header (``"<len> <key>=<value>\\n"`` records), None
    where absent. A size is decimal digits only (no sign, space or exponent), as POSIX writes it."""
    path, size, pos = None, None, 0
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
        elif keyword == b"size":
            if not (value.isdigit() and value.isascii() and len(value) <= MAX_SIZE_DIGITS):
                raise ValueError(f"pax size record {bytes(value[:40])!r} is not a decimal size")
            size = int(value)
        pos = end
    return path, size


# -- the byte source ------------------------------------------------------------------------------------------------
class ByteSource:
    """A forward-only tar byte stream: tracks the offset, seeks over bytes it may skip, hashes when asked, and takes
    back one header block a scan read too far."""

    def __init__(self, handle: BinaryIO, where: str, *, total: int | None, hashing: bool, offset: int = 0):
        self.handle = handle
        self.where = where
        self.total = total  # file size, None for a stream of unknown length
        self.offset = offset  # in the shard: a ranged read starts where its first sample does
        self.member_start = offset
        self.header_start = offset  # where the last header read starts (where damage is charged)
        self.padding = 0  # bytes after the current member's data, skipped before the next header
        self.pushed = b""  # a block read back by ``unread``
        self.digest = hashlib.sha256() if hashing else None
        self.can_seek = total is not None and not hashing

    def read(self, size: int, key: str | None = None) -> bytes:
        pushed = b""
        if self.pushed:  # already hashed when first read
            pushed, self.pushed = self.pushed[:size], self.pushed[size:]
            self.offset += len(pushed)
            size -= len(pushed)
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
        return pushed + data if pushed else data

    def unread(self, block: bytes) -> None:
        self.pushed = block + self.pushed
        self.offset -= len(block)

    def skip(self, size: int) -> None:
        if self.pushed and size > 0:
            dropped = min(size, len(self.pushed))
            self.pushed = self.pushed[dropped:]
            self.offset += dropped
            size -= dropped
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


def read_member(source: ByteSource) -> tuple[str, int] | None:
    """``(name, size)`` of the next regular member, leaving the source at its data; None at the end of the archive.
    ``source.member_start`` is where the member's first header (a pax or GNU long-name header, if any) starts.
    A damaged header is a ``CorruptDataError``; ``source.header_start`` says where it starts."""
    source.skip(source.padding)
    source.padding = 0
    extended = False  # extended headers were read for the coming member: its first header started there
    long_name: str | None = None  # from a GNU long-name header or a pax path record
    pax_size: int | None = None
    while True:
        offset = source.header_start = source.offset
        if not extended:
            source.member_start = offset
        header = source.read(BLOCK)
        if len(header) < BLOCK:
            if header:
                raise CorruptDataError(f"truncated tar header at byte {offset}", path=source.where)
            return None
        if header == ZERO_BLOCK:  # the end-of-archive marker, unless bytes follow it: then a zeroed header
            after = source.read(BLOCK)
            if len(after) < BLOCK or after == ZERO_BLOCK:
                return None
            source.unread(after)
            raise CorruptDataError(f"bad tar header at byte {offset} (all zeros, data follows)", path=source.where)
        try:
            if not _checksum_ok(header):
                raise ValueError("checksum mismatch")
            size = _octal(header[124:136], "size")
            kind = header[156:157]
            name = None if long_name is not None or kind not in REGULAR else header_name(header)
        except ValueError as exc:
            raise CorruptDataError(f"bad tar header at byte {offset} ({exc})", path=source.where,
                                   key=_guess_key(header)) from None
        if pax_size is not None and kind not in (b"L", b"x"):
            size = pax_size
        key = split_member_name(long_name if name is None else name)[0] if kind in REGULAR else None
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
                path, size_record = (_text(payload, "GNU long name"), None) if kind == b"L" else _pax_records(payload)
            except ValueError as exc:
                raise CorruptDataError(f"bad tar header at byte {offset} ({exc})", path=source.where) from None
            long_name = long_name if long_name is not None else path
            pax_size = pax_size if pax_size is not None else size_record
            extended = True
            continue
        if kind not in REGULAR:
            source.skip(padded)
            extended, long_name, pax_size = False, None, None
            continue
        source.padding = padded - size
        return (long_name if name is None else name), size
