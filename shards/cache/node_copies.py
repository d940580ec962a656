"""One copy in the node cache (``shards.cache.node``): whether a copy may be served, and writing a fetched one.

A copy is served only once this process has checked it: its stamp ``<name>.ok`` must record its size, mtime_ns,
inode and the manifest's sha256, and its bytes must hash to that sha256 (once per process per copy, remembered in
``CacheIndex.verified``), because a stamp vouches only for size and mtime, which a change in place can keep. A
fetched copy is hashed while it is written, checked against the manifest's size and sha256, fsynced and renamed
before its stamp is written, so no byte of a bad copy is ever served and a killed writer leaves only a temp file.

It is kept apart from leasing and room (``NodeCache``, ``shards.cache.node_index``) so that what makes a copy
trusted reads in one place. Anything under the folder may have been planted (``shards.cache.node_locks``): only a
regular file, never a link, is a copy, hashed through a non-blocking open, and a stamp of another shape is never
trusted.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from shards.atomic import unique_tmp_path, write_json_atomic
from shards.cache.node_index import CacheIndex, stamp_path
from shards.cache.node_locks import read_cache_json, unlink, warn_once
from shards.door.bounded_read import open_regular_file
from shards.door.shape import as_int, as_object, as_str
from shards.errors import ChecksumError, ShardcacheError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
UNUSABLE = "unusable"  # a planted lock, folder or file stands in the way: read the source (warned once)
NOT_A_FOLDER = "not a folder of the node cache (a link or a file); reading around it"
MAX_STAMP_BYTES = 4096  # a stamp is four fields, under 200 bytes
COPY_OK, COPY_MISSING, COPY_BAD, COPY_CORRUPT = "ok", "missing", "bad", "corrupt"


class _HashingWriter(io.RawIOBase):
    """The file object handed to ``fetch``: counts and hashes the bytes on their way to disk, so the copy is
    verified without reading it back, and stops a source that sends more than the manifest says."""

    def __init__(self, handle: BinaryIO, expected_size: int, source: str):
        super().__init__()
        self._handle, self._expected, self._source = handle, expected_size, source
        self.size = 0
        self._digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.size + view.nbytes > self._expected:
            raise ChecksumError(f"the source sent more than the manifest's {self._expected} bytes", path=self._source)
        self._digest.update(view)
        self._handle.write(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


class Copies:
    """The copies of one cache folder, checked and written for ``NodeCache`` through the folder's ``CacheIndex``
    (its folders, removals and the copies this process has verified, which both sides must see alike)."""

    def __init__(self, index: CacheIndex):
        self._index = index

    def check(self, path: Path, sha256: str, size: int) -> str:
        """``COPY_OK`` once this process has checked the copy (stamp, then sha256 of its bytes) and it is unchanged
        since; ``COPY_MISSING``; ``COPY_BAD`` when the stamp does not vouch for it; ``COPY_CORRUPT`` when its bytes
        are not the shard's."""
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return COPY_MISSING
        if not stat.S_ISREG(info.st_mode):  # a planted link, FIFO or folder is no copy
            return COPY_BAD
        signature = (info.st_size, info.st_mtime_ns, info.st_ino)
        if self._index.verified.get(str(path)) == signature and info.st_size == size:
            return COPY_OK
        if stamped(path) != (*signature, sha256) or info.st_size != size:
            return COPY_BAD
        # The stamp vouches only for size and mtime, which an in-place change can keep: hash once per process.
        digest = sha256_of(path)
        if digest is None:
            return COPY_MISSING
        if digest != sha256:
            return COPY_CORRUPT
        self._index.verified[str(path)] = signature
        return COPY_OK

    @staticmethod
    def rehash_matches(path: Path, sha256: str) -> bool:
        """Whether the copy's bytes still match its stamp and ``sha256``, whatever this process checked before: a
        health check (``NodeCache.verify_all``) must catch a change made since."""
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return False
        signature = (info.st_size, info.st_mtime_ns, info.st_ino)
        return stat.S_ISREG(info.st_mode) and stamped(path) == (*signature, sha256) and sha256_of(path) == sha256

    def download(self, path: Path, sha256: str, size: int, fetch: Callable[[BinaryIO], None], source: str) -> int | str:
        """Bytes written under the final name, or ``UNUSABLE`` when this process cannot write in the entry's
        folder (a planted link, another user's folder; warned once)."""
        try:
            if not self._index.make_folder(path.parent):
                warn_once(path.parent, NOT_A_FOLDER)
                return UNUSABLE
            tmp = unique_tmp_path(path)
            handle = open(tmp, "xb")
        except OSError as exc:
            if exc.errno in DISK_FULL:
                raise
            warn_once(path.parent, f"cannot write in this node-cache folder ({exc.strerror or exc}); reading "
                                   "around it")
            return UNUSABLE
        placed = False
        try:
            with handle:
                writer = _HashingWriter(handle, size, source)
                fetch(writer)  # type: ignore[arg-type]
                if writer.size != size or writer.hexdigest() != sha256:
                    raise ChecksumError(f"the bytes fetched for the node cache ({writer.size} bytes, sha256 "
                                        f"{writer.hexdigest()}) do not match the manifest ({size} bytes, sha256 "
                                        f"{sha256})", path=source)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            placed = True
            info = os.stat(path)
            write_json_atomic(stamp_path(path), {"size": info.st_size, "mtime_ns": info.st_mtime_ns,
                                                  "inode": info.st_ino, "sha256": sha256})  # fsyncs the folder
        except BaseException:
            unlink(tmp)
            if placed:
                self._index.remove_entry(path)
            raise
        self._index.verified[str(path)] = (info.st_size, info.st_mtime_ns, info.st_ino)
        return writer.size


def stamped(path: Path) -> tuple[int, int, int, str] | None:
    """What the copy's stamp records: (size, mtime_ns, inode, sha256); None when it is missing or is no stamp
    this cache wrote (a planted one of another shape is never trusted)."""
    where = stamp_path(path)
    try:
        stamp = as_object(read_cache_json(where, MAX_STAMP_BYTES), "the stamp")
        return (as_int(stamp.get("size"), "size"), as_int(stamp.get("mtime_ns"), "mtime_ns", hi=1 << 64),
                as_int(stamp.get("inode"), "inode", hi=1 << 64), as_str(stamp.get("sha256"), "sha256"))
    except ShardcacheError:
        return None


def sha256_of(path: Path) -> str | None:
    """The sha256 of the regular file ``path`` (opened without blocking: a FIFO swapped in is refused, not waited
    on); None when it is gone or is not a regular file."""
    try:
        with open_regular_file(path) as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except (ShardcacheError, OSError):
        return None
