"""Which tars a ``shards index`` source names, where each is read from, and its state as listed.

A source is a local folder (its ``*.tar`` files, subfolders too), a ``.tar`` path or brace pattern
(``shards-{000..099}.tar``, expanded by the pack source's ``expand_braces``: no shell), an ``s3://`` prefix (its
``.tar`` objects, listed) or brace pattern, or an ``http(s)://`` brace pattern (HTTP has no listing). Each tar gets
its name relative to the source's base, which is what the index records and what the reader joins under the
caller's ``base_url`` (``shards.door.locations.shard_location``, which refuses ``..`` and other unsafe names): so a
tar is always read here from the location that join gives, never from a name outside the base.

A local tar is read only where it lies inside the base: one that resolves outside it (a symlink to
``/etc/passwd`` or to a tar elsewhere, a symlinked folder) is never opened, only listed as refused with the reason
(``shards.door.locations.local_shard_path``, the rule the reader holds every name to).
An object of a listed ``s3://`` prefix whose key is unusable as a shard name (a control character, an empty,
``.`` or ``..`` part: ``shards.door.locations.check_shard_path``) is listed as refused the same way, its key shown
escaped, and the rest of the prefix is indexed: one stray key costs that object, not the prefix.

Its state as listed is what an incremental run compares: the size, and a version that moves when the bytes may
have moved (a local file's ``mtime_ns``; an object's ``etag`` and ``last_modified``). One record format holds both
(docs/packing.md, "Adopting WebDataset shards in place").
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from preprocess.pack.sources.tars import expand_braces, is_tar_pattern, tar_files
from shards.door.locations import check_shard_path, local_shard_path, shard_location, url_origin
from shards.errors import ChecksumError, InputError, ManifestError, MissingInputError
from shards.transport.location import CHUNK, Location, locate


@dataclass(frozen=True)
class SourceTar:
    """One tar: ``rel`` (its name under the base), ``location`` (where it is read), ``size`` and ``version`` as
    listed."""

    rel: str
    location: Location
    size: int
    version: Mapping[str, Any]

    @property
    def where(self) -> str:
        return self.location.text


def is_remote_source(source: str) -> bool:
    return source.startswith(("s3://", "http://", "https://"))


def local_version(path: str) -> tuple[int, dict[str, Any]]:
    info = os.stat(path)
    return info.st_size, {"mtime_ns": info.st_mtime_ns}


def source_tars(source: str, *, storage_options: Any = None
                ) -> tuple[str, list[SourceTar], list[tuple[str, str]]]:
    """The base, every tar of ``source`` (see the module) in name order, and the ones refused unread
    (``(name, reason)``: local ones resolving outside the base, listed keys unusable as shard names)."""
    refused: list[tuple[str, str]] = []
    if source.startswith("s3://"):
        base, tars = _s3_tars(source, storage_options, refused)
    elif source.startswith(("http://", "https://")):
        base, tars = _http_tars(source, storage_options)
    elif "://" in source or source.startswith("pipe:"):
        raise InputError("is not a folder, a .tar path or pattern, an s3:// prefix or an http(s):// pattern",
                         path=source)
    else:
        base, tars = _local_tars(source, refused)
    return base, sorted(tars, key=lambda tar: tar.rel), refused


def _local_tars(source: str, refused: list[tuple[str, str]]) -> tuple[str, list[SourceTar]]:
    if os.path.isdir(source):
        base = os.path.abspath(source)
        found = sorted(p.relative_to(base).as_posix() for p in Path(base).rglob("*.tar") if p.is_file())
        if not found:
            raise MissingInputError("holds no .tar files", path=source)
        pairs = [(os.path.join(base, rel), rel) for rel in found]
    else:
        base, pairs = tar_files(os.path.join(os.getcwd(), source))
    inside = []
    for path, rel in pairs:
        try:
            inside.append((str(local_shard_path(base, rel, where=source, what="tar")), rel))
        except ManifestError:  # never opened: its bytes, size, hash and target stay out of the index
            refused.append((rel, "resolves outside the source folder (a symlink, or a name leaving it): not read"))
    if not inside:
        raise MissingInputError(f"holds no .tar files inside it ({refused[0][1]})", path=source)
    return base, [SourceTar(rel, locate(path), *local_version(path)) for path, rel in inside]


def _pattern_base(urls: list[str], pattern: str) -> tuple[str, list[str]]:
    """The deepest ``/``-folder holding every URL, and each URL's name under it (checked: no ``..``, no scheme,
    nothing that could leave the base)."""
    if len(set(urls)) != len(urls):
        raise InputError("names a tar twice", path=pattern)
    scheme = pattern.split("://", 1)[0] + "://"
    paths = [url[len(scheme):] for url in urls]
    if any(not url.startswith(scheme) for url in urls) or len({p.split("/", 1)[0] for p in paths}) != 1:
        raise InputError("a pattern must stay on one host or bucket", path=pattern)
    folders = [posixpath.dirname(p) for p in paths]
    common = posixpath.commonpath(folders) if all(folders) else ""
    if not common:
        raise InputError("names tars outside any folder of the host or bucket", path=pattern)
    base = scheme + common
    return base, [check_shard_path(p[len(common) + 1:], where=pattern, what="tar") for p in paths]


def _s3_tars(source: str, storage_options: Any, refused: list[tuple[str, str]]) -> tuple[str, list[SourceTar]]:
    from shards.transport.s3_ranges import list_objects

    pattern = is_tar_pattern(source)
    if pattern:
        base, wanted = _pattern_base(expand_braces(source), source)
    else:
        base, wanted = source.rstrip("/"), None
    listed = {}
    for rel, size, etag, modified in list_objects(base, storage_options):
        if wanted is None:
            if not rel.endswith(".tar"):
                continue
            try:
                check_shard_path(rel, what="tar")
            except ManifestError as exc:  # never read; its key is recorded escaped (repr), so it stays one line
                refused.append((repr(rel)[1:-1], f"{exc.reason}: its object is not read"))
                continue
        listed[rel] = (size, {"etag": etag, "last_modified": modified})
    names = sorted(listed) if wanted is None else wanted
    if not names:
        raise MissingInputError("holds no .tar objects" + (f" usable as shard names ({refused[0][1]})"
                                                           if refused else ""), path=source)
    tars = []
    for rel in names:
        if rel not in listed:
            raise MissingInputError(f"no such object (from the pattern {source})", path=f"{base}/{rel}")
        check_shard_path(rel, where=source, what="tar")  # a key with a '..' or empty part is refused, not followed
        where = locate(shard_location(base, rel), storage_options=storage_options)
        tars.append(SourceTar(rel, where, *listed[rel]))
    return base, tars


def _http_tars(source: str, storage_options: Any) -> tuple[str, list[SourceTar]]:
    from shards.transport.remote import object_state

    if not is_tar_pattern(source):
        raise InputError("an http(s) source is a .tar URL or a brace pattern of them (HTTP has no listing)",
                         path=source)
    base, names = _pattern_base(expand_braces(source), source)
    if url_origin(base) is None:
        raise InputError("is not an http(s) URL with a host", path=source)
    tars = []
    for rel in names:
        where = locate(shard_location(base, rel), storage_options=storage_options)
        size, etag, modified = object_state(where.text, limits=where.limits())
        if size is None:  # the one bound on what its streaming read may copy
            raise InputError("the server gives no Content-Length for it: its size cannot be checked",
                             path=where.text)
        tars.append(SourceTar(rel, where, size, {"etag": etag, "last_modified": modified}))
    return base, tars


def same_bytes(tar: SourceTar, size: int, sha256: str) -> bool:
    """Whether ``tar`` still holds the ``size`` bytes of sha256 ``sha256`` (one streaming read, nothing kept)."""
    try:
        tar.location.check(size, sha256)
    except ChecksumError:
        return False
    return True


def stage(tar: SourceTar, dest: Path) -> tuple[int, str]:
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
