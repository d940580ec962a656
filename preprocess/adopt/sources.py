"""Which tars a ``shards index`` source names, where each is read from, and its state as listed.

A source is a local folder (its ``*.tar`` files, subfolders too), a ``.tar`` path or brace pattern
(``shards-{000..099}.tar``: no shell), an ``s3://`` prefix (its ``.tar`` objects, listed) or brace pattern, or an
``http(s)://`` brace pattern (HTTP has no listing): whatever the location layer lists (``Location.list``, one rule
for every kind, ``shards.transport.listing``). Each tar gets its name relative to the source's base, which is what
the index records and what the reader joins under the caller's ``base_url`` (``shards.door.locations.shard_location``,
which refuses ``..`` and other unsafe names): so a tar is always read here from the location that join gives, never
from a name outside the base. Names the listing refuses unread (a local tar resolving outside the base, a key
unusable as a shard name) are recorded as refused with the reason; the rest of the source is indexed.

Its state as listed is what an incremental run compares: the size, and a version that moves when the bytes may
have moved (a local file's ``mtime_ns``; an object's ``etag`` and ``last_modified``). One record format holds both
(docs/packing.md, "Adopting WebDataset shards in place").
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from shards.errors import ChecksumError
from shards.transport.listing import Listed
from shards.transport.location import locate
from shards.transport.whole_reads import CHUNK


def local_version(path: str) -> tuple[int, dict[str, Any]]:
    info = os.stat(path)
    return info.st_size, {"mtime_ns": info.st_mtime_ns}


def source_tars(source: str, *, storage_options: Any = None) -> tuple[str, list[Listed], list[tuple[str, str]]]:
    """The base, every tar of ``source`` (see the module) in name order, and the ones refused unread
    (``(name, reason)``)."""
    listing = locate(source, storage_options=storage_options).list("*.tar")
    return listing.base.text, list(listing.files), list(listing.refused)


def same_bytes(tar: Listed, size: int, sha256: str) -> bool:
    """Whether ``tar`` still holds the ``size`` bytes of sha256 ``sha256`` (one streaming read, nothing kept)."""
    try:
        tar.location.check(size, sha256)
    except ChecksumError:
        return False
    return True


def stage(tar: Listed, dest: Path) -> tuple[int, str]:
    """Copy the remote ``tar`` to ``dest`` in one streaming read (no more than its listed size and one byte),
    hashing it on the way: ``(size, sha256)``. A size other than the listed one means it changed meanwhile."""
    digest, total = hashlib.sha256(), 0
    dest.unlink(missing_ok=True)  # a file planted under this name is replaced, never written through
    created = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(created, "wb") as out, tar.location.open() as stream:
        while total <= tar.size and (data := stream.read(min(CHUNK, tar.size + 1 - total))):
            out.write(data)
            digest.update(data)
            total += len(data)
    if total != tar.size:
        raise ChecksumError(f"changed while it was being indexed ({'more than ' if total > tar.size else ''}"
                            f"{total} bytes, listed as {tar.size}); index it again once it is complete",
                            path=tar.where)
    return total, digest.hexdigest()
