"""WebDataset tar shards: a deterministic writer and a sequential streaming reader.

Members per sample are ``<key>.<ext>`` (the encoded image), ``<key>.cls`` (the label in ASCII digits) and
``<key>.json`` (metadata), so plain ``webdataset.WebDataset(urls).decode("pil").to_tuple("jpg;png;webp", "cls")``
reads them. The writer fixes mtime, uid, gid, owner names and mode, so the same samples in the same order give
byte-identical tars.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path
from typing import BinaryIO, Iterator, Sequence

from shards.atomic import atomic_output
from shards.errors import CorruptDataError
from shards.formats.sample import IMAGE_EXTENSIONS, RawSample

FIXED_MTIME = 0
FIXED_MODE = 0o444


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = FIXED_MTIME
    info.mode = FIXED_MODE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE


class TarShardWriter:
    """Write one tar shard atomically; ``sha256``, ``bytes`` and ``samples`` are set after the ``with`` block.

    Headers and payloads are written straight to the file (what ``tarfile``'s ``w|`` mode writes, byte for byte,
    without its 10 kB copy loop), hashing as they go, so the checksum costs no second read.
    """

    suffix = ".tar"

    def __init__(self, path: str | os.PathLike, classes: Sequence[str] = ()):
        # classes are accepted for a uniform writer signature; tar shards carry labels per sample only.
        self.path = Path(path)
        self.samples = 0
        self.sha256 = ""
        self.bytes = 0

    def __enter__(self) -> "TarShardWriter":
        self._atomic = atomic_output(self.path)
        tmp = self._atomic.__enter__()
        self._file = open(tmp, "wb", buffering=1 << 20)
        self._digest = hashlib.sha256()
        self._written = 0
        return self

    def _put(self, data: bytes) -> None:
        self._file.write(data)
        self._digest.update(data)
        self._written += len(data)

    def write(self, sample: RawSample) -> None:
        for suffix, payload in (
            (sample.ext, sample.data),
            ("cls", str(sample.label).encode("ascii")),
            ("json", sample.meta),
        ):
            info = _member(f"{sample.key}.{suffix}", len(payload))
            self._put(info.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape"))
            self._put(payload)
            if len(payload) % BLOCK:
                self._put(bytes(BLOCK - len(payload) % BLOCK))
        self.samples += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                end = 2 * BLOCK  # the end-of-archive marker, then zeros up to a whole record
                self._put(bytes(end + (-(self._written + end)) % RECORD))
                self._file.flush()
                self.sha256 = self._digest.hexdigest()
                self.bytes = self._written
        finally:
            self._file.close()
        self._atomic.__exit__(exc_type, exc, tb)


def _split_member_name(name: str) -> tuple[str, str]:
    # webdataset's rule: the key is everything before the first dot of the last path component.
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def iter_tar_stream(stream: BinaryIO, where: str) -> Iterator[RawSample]:
    """Yield the samples of a tar stream in order; members of one sample must be adjacent (as written)."""
    key = None
    parts: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                member_key, ext = _split_member_name(info.name)
                if key is not None and member_key != key:
                    yield _assemble(key, parts, where)
                    parts = {}
                key = member_key
                handle = tar.extractfile(info)
                parts[ext.lower()] = handle.read() if handle is not None else b""
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise CorruptDataError(f"unreadable tar ({exc})", path=where, key=key) from exc
    if key is not None:
        yield _assemble(key, parts, where)


def _assemble(key: str, parts: dict[str, bytes], where: str) -> RawSample:
    try:
        label = int(parts["cls"])
    except (KeyError, ValueError) as exc:
        raise CorruptDataError("missing or malformed .cls member", path=where, key=key) from exc
    for ext in IMAGE_EXTENSIONS:
        if ext in parts:
            return RawSample(key, parts[ext], ext, label, parts.get("json", b""))
    raise CorruptDataError(f"no image member (found {sorted(parts)})", path=where, key=key)


def iter_tar_shard(path: str | os.PathLike, buffer_size: int = 1 << 20) -> Iterator[RawSample]:
    """Read a local tar shard sequentially with a large buffer (one seek-free pass)."""
    with open(path, "rb", buffering=buffer_size) as handle:
        yield from iter_tar_stream(handle, str(path))
