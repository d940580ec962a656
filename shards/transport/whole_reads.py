"""Reading a location's object whole: checked against the manifest's size and sha256, copied to a local file, or
read as a small file within the bounded-read rules (docs/design.md, section 4).

Every kind of ``shards.transport.location.Location`` reads its whole objects through these methods, built only on
the kind's own ``open`` and ``open_sized``: so the checks are one implementation whatever the bytes' origin, and a
kind overrides only what it can do better (a local file is its own copy; a local manifest is opened only if it is a
regular file).
"""

from __future__ import annotations

import hashlib
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, ContextManager, Iterator

from shards.door.bounded_read import JSONError, parse_json, read_capped
from shards.errors import ChecksumError, ManifestError

CHUNK = 8 << 20  # bytes per read when a whole object streams through (fetching, copying)


class WholeReads:
    """The whole-object reads of a location (``text``, ``open``, ``open_sized``: the kind's)."""

    text: str

    def open(self) -> ContextManager[BinaryIO]:
        raise NotImplementedError

    def open_sized(self, size: int) -> ContextManager[BinaryIO]:
        raise NotImplementedError

    def fetch_checked(self, size: int, sha256: str | None) -> bytes:
        """The whole object in one streaming read, its size and sha256 checked against the manifest on the way
        (reading stops once it is longer than ``size``); a mismatch is a ``ChecksumError`` naming it."""
        parts: list[bytes] = []
        self._read_checked(size, sha256, parts.append)
        return b"".join(parts)

    def check(self, size: int, sha256: str | None) -> None:
        """``fetch_checked`` without keeping the bytes: memory stays one chunk whatever the object's size."""
        self._read_checked(size, sha256, None)

    def _read_checked(self, size: int, sha256: str | None, keep: Any) -> None:
        digest, total = hashlib.sha256(), 0
        with self.open_sized(size) as stream:
            while total <= size and (data := stream.read(CHUNK)):
                digest.update(data)
                if keep is not None:
                    keep(data)
                total += len(data)
        if total != size:
            raise ChecksumError(f"{'more than ' if total > size else ''}{total} bytes, the manifest records {size} "
                                "(truncated or replaced)", path=self.text)
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ChecksumError("sha256 does not match the manifest (corrupt or replaced)", path=self.text)

    @contextmanager
    def local_copy(self, limit: int | None = None) -> Iterator[Path]:
        """A file on this machine holding these bytes, unchecked (the caller checks them): a local file itself,
        else a temporary copy under the same file name (so messages still name the shard), made in one streaming
        read of at most ``limit`` bytes and removed afterwards."""
        with tempfile.TemporaryDirectory(prefix="shardcache-copy-") as folder:
            path = Path(folder) / (self.text.rstrip("/").rsplit("/", 1)[-1] or "object")
            with self.open() as stream, open(path, "wb") as out:
                copied = 0
                while (limit is None or copied < limit) and (data := stream.read(
                        CHUNK if limit is None else min(CHUNK, limit - copied))):
                    out.write(data)
                    copied += len(data)
            yield path

    def read_capped(self) -> bytes:
        """A small file's bytes whole (a manifest): at most ``shards.door.bounded_read.MAX_FILE_BYTES``, else a
        ``ManifestError`` naming it."""
        with self.open() as stream:
            return read_capped(stream, self.text)

    def read_json(self) -> Any:
        """The JSON value of a small file (``read_capped``, then ``json_of``)."""
        return self.json_of(self.read_capped())

    def json_of(self, payload: bytes) -> Any:
        """``payload`` (this file's bytes) parsed, at most 64 levels deep; ``ManifestError`` naming it if not."""
        try:
            return parse_json(payload)
        except JSONError as exc:
            raise ManifestError(str(exc), path=self.text) from None
