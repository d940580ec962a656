"""WebDataset tar shards: a deterministic writer and a sequential streaming reader.

Members per sample are ``<key>.<ext>`` (the encoded image), ``<key>.cls`` (the label in ASCII digits) and
``<key>.json`` (metadata), so plain ``webdataset.WebDataset(urls).decode("pil").to_tuple("jpg;png;webp", "cls")``
reads them. The writer fixes mtime, uid, gid, owner names and mode, so the same samples in the same order give
byte-identical tars. Beside each shard the writer leaves its per-sample byte index ``<shard>.idx``
(``shards.formats.tarindex``), written before the shard is renamed into place, so a finished shard always has it.
Reading lives in ``shards.formats.tarseek`` (seeking, grouping, resync after damage) over ``shards.formats.tarheader``
(strict header parsing).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tarfile
from pathlib import Path
from typing import Iterator, Sequence

from shards.atomic import atomic_output, write_bytes_atomic
from shards.formats.sample import RawSample
from shards.formats.tarindex import index_bytes, index_name
from shards.formats.tarseek import iter_tar_slice, iter_tar_stream

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
    """Write one tar shard atomically; ``sha256``, ``bytes``, ``samples``, ``index`` (the sidecar's file name)
    and ``index_sha256`` are set after the ``with`` block.

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
        self.offsets: list[int] = []  # where each sample's first header starts
        self.index: str | None = None
        self.index_sha256: str | None = None

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
        self.offsets.append(self._written)
        for suffix, payload in (
            (sample.ext, sample.data),
            ("cls", str(sample.label).encode("ascii")),
            ("json", sample.meta),
            *sample.extra,
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
                data_end = self._written
                end = 2 * BLOCK  # the end-of-archive marker, then zeros up to a whole record
                self._put(bytes(end + (-(self._written + end)) % RECORD))
                self._file.flush()
                self.sha256 = self._digest.hexdigest()
                self.bytes = self._written
                self._write_index(data_end)
            self._file.close()  # a full disk may refuse the last buffered bytes here: the except cleans up
        except BaseException:
            try:
                self._file.close()
            finally:
                self._atomic.__exit__(*sys.exc_info())
            raise
        self._file.close()
        self._atomic.__exit__(exc_type, exc, tb)

    def _write_index(self, data_end: int) -> None:
        # Before the shard's rename: a shard under its final name always has its sidecar beside it.
        data = index_bytes([*self.offsets, data_end])
        self.index = index_name(self.path.name)
        write_bytes_atomic(self.path.with_name(self.index), data)
        self.index_sha256 = hashlib.sha256(data).hexdigest()


def iter_tar_shard(path: str | os.PathLike) -> Iterator[RawSample]:
    """Every sample of a local tar shard, in order (one sequential pass; member sizes checked against the file)."""
    return iter_tar_slice(path)


__all__ = ["TarShardWriter", "iter_tar_shard", "iter_tar_stream"]
