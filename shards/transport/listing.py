"""Listing a location: the files a folder, an ``s3://`` prefix or a brace pattern names (docs/design.md, section 4).

``Location.list(pattern)`` comes here, and one rule holds for every kind:

- A folder (a local directory; on ``s3://``, a prefix that spells no file) is walked: every file under it, at any
  depth, whose name relative to it matches the glob ``pattern`` (``fnmatch``, ``*`` crossing ``/``). Only a kind
  that can list has folders (``Location.can_list``: local, ``s3://``); ``http(s)`` has no listing.
- Anything else spells its files: a brace pattern (``shards-{000..099}.tar``, ``{a,b}``: ``expand_braces``, no
  shell), or one name. Each must exist; their base is the deepest folder holding them all.

Every file is named relative to the base, which is what an index records and a reader joins again under a base of
the caller's (``shards.door.locations.shard_location``). A name unusable as one (a control character, an empty,
``.`` or ``..`` part: ``check_shard_path``) or, locally, one that resolves outside the base (a symlink) is refused,
never read: listed in ``Listing.refused`` with the reason (a key shown escaped, so it stays one line), and the rest is
listed as usual: one stray name costs that file, not the folder. Each file comes with its size and a version that
moves when its bytes may have (a local file's ``mtime_ns``; an object's ETag and Last-Modified).

``list_objects`` is the one lister of ``s3://`` prefixes, for readers and writers alike (``shards index``, the
publish's check of a prefix): every page retried under the S3 policy (``shards.transport.s3.retried_call``).
"""

from __future__ import annotations

import fnmatch
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from shards.door.locations import check_shard_path, local_shard_path, url_origin
from shards.errors import CorruptDataError, InputError, ManifestError, MissingInputError

MAX_EXPANDED = 100_000  # files one pattern may name
NOT_LISTABLE = "cannot be listed: it is not a folder, a path or brace pattern, an s3:// prefix or an http(s):// pattern"
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)\Z")


@dataclass(frozen=True)
class Listed:
    """One file: ``rel`` (its name under the listing's base), ``location`` (where it is read), ``size`` and
    ``version`` as listed."""

    rel: str
    location: Any  # a shards.transport.location.Location (that module imports this one)
    size: int
    version: Mapping[str, Any]

    @property
    def where(self) -> str:
        return self.location.text


@dataclass(frozen=True)
class Listing:
    """What ``Location.list`` found: the base (a location), its files in name order, and the names refused unread
    (``(name, reason)``)."""

    base: Any
    files: tuple[Listed, ...]
    refused: tuple[tuple[str, str], ...] = ()


def expand_braces(pattern: str) -> list[str]:
    """Every name the pattern spells, in order: ``{000..099}`` (zero-padded to the first bound's width) and
    ``{a,b}``, as many braces as given (no nesting)."""
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    numbers = _RANGE.match(body)
    if numbers:
        low, high = int(numbers.group(1)), int(numbers.group(2))
        if abs(high - low) >= MAX_EXPANDED:
            raise InputError(f"{{{body}}} names more than {MAX_EXPANDED} files", path=pattern)
        width = len(numbers.group(1).lstrip("-")) if numbers.group(1).lstrip("-").startswith("0") else 0
        step = 1 if high >= low else -1
        choices = [f"{n:0{width}d}" for n in range(low, high + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:
        raise InputError(f"{{{body}}} is neither a range {{000..099}} nor a list {{a,b}}", path=pattern)
    head, tail = pattern[:match.start()], pattern[match.end():]
    expanded: list[str] = []
    for choice in choices:
        expanded.extend(expand_braces(head + choice + tail))
        if len(expanded) > MAX_EXPANDED:
            raise InputError(f"names more than {MAX_EXPANDED} files", path=pattern)
    return expanded


def spells_files(text: str, pattern: str) -> bool:
    """Whether ``text`` names files itself (a brace pattern, or a name matching ``pattern``, case aside) rather
    than a folder to walk."""
    return bool(_BRACE.search(text)) or fnmatch.fnmatch(text.lower(), pattern.lower())


def _things(pattern: str, things: str) -> str:
    """What the messages call the files looked for: ``"*.tar"`` -> ``".tar files"``, else ``"files matching ..."``."""
    suffix = pattern[1:] if pattern.startswith("*") else ""
    if suffix and not any(c in suffix for c in "*?[/"):
        return f"{suffix} {things}"
    return f"{things} matching {pattern}"


# -- local ------------------------------------------------------------------------------------------------------------
def local_files(pattern_text: str) -> tuple[str, list[tuple[str, str]]]:
    """The base folder and ``(absolute path, path relative to it)`` of every file a local path or brace pattern
    names, each of which must exist."""
    paths = [os.path.abspath(p) for p in expand_braces(pattern_text)]
    if len(set(paths)) != len(paths):
        raise InputError("names a file twice", path=pattern_text)
    for path in paths:
        if not os.path.exists(path):
            raise MissingInputError("no such tar file" + (f" (from the pattern {pattern_text})"
                                                          if path != pattern_text else ""), path=path)
    base = os.path.commonpath([os.path.dirname(p) for p in paths])
    return base, [(p, Path(p).relative_to(base).as_posix()) for p in paths]


def list_local(where: Any, pattern: str) -> Listing:
    """``Location.list`` of a local folder, path or brace pattern (see the module)."""
    source = where.text
    if "://" in source:  # a URL of a kind this layer does not read, taken for a path by ``locate``
        raise InputError(NOT_LISTABLE, path=source)
    if os.path.isdir(source):
        base = os.path.abspath(source)
        names = (p.relative_to(base).as_posix() for p in Path(base).rglob("*") if p.is_file())
        found = sorted(name for name in names if fnmatch.fnmatchcase(name, pattern))
        if not found:
            raise MissingInputError(f"holds no {_things(pattern, 'files')}", path=source)
        pairs = [(os.path.join(base, rel), rel) for rel in found]
    else:
        base, pairs = local_files(os.path.join(os.getcwd(), source))
    inside, refused = [], []
    for path, rel in pairs:
        try:
            inside.append((str(local_shard_path(base, rel, where=source, what="file")), rel))
        except ManifestError:  # never opened: its bytes, size, hash and target stay out of the listing
            refused.append((rel, "resolves outside the source folder (a symlink, or a name leaving it): not read"))
    if not inside:
        raise MissingInputError(f"holds no {_things(pattern, 'files')} inside it ({refused[0][1]})", path=source)
    files = []
    for path, rel in inside:
        info = os.stat(path)
        files.append(Listed(rel, where.at(path), info.st_size, {"mtime_ns": info.st_mtime_ns}))
    return Listing(where.at(base), tuple(sorted(files, key=lambda f: f.rel)), tuple(refused))


# -- remote -----------------------------------------------------------------------------------------------------------
def spelled_base(urls: list[str], pattern: str) -> tuple[str, list[str]]:
    """The deepest ``/``-folder holding every URL a pattern spells, and each URL's name under it (checked: no
    ``..``, no scheme, nothing that could leave the base)."""
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
    return scheme + common, [check_shard_path(p[len(common) + 1:], where=pattern, what="tar") for p in paths]


def list_objects(url: str, options: Any = None) -> Iterator[tuple[str, int, str, str]]:
    """Every object under the prefix ``url`` names (``s3://bucket/prefix``: the keys under ``prefix/``), as
    ``(key relative to the prefix, size, ETag, Last-Modified)``, a page at a time, each page retried. Keys come as
    listed (botocore asks for them url-encoded, so a control character survives the XML) and unchecked: a writer
    names every object it finds, a reader skips the ones its rule refuses (``list_s3``)."""
    from shards.transport import s3

    options = s3.S3Options.from_mapping(options)
    bucket, prefix = s3.parse_s3_url(url)
    start = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
    client = s3.make_client(options)
    token = None
    while True:
        kwargs = {"Bucket": bucket, "Prefix": start, **({"ContinuationToken": token} if token else {})}
        page = s3.retried_call(url, options, lambda kwargs=kwargs: client.list_objects_v2(**kwargs))
        for item in page.get("Contents", []):
            modified = item.get("LastModified")
            yield (str(item["Key"])[len(start):], int(item["Size"]), str(item.get("ETag", "")),
                   modified.isoformat() if hasattr(modified, "isoformat") else str(modified or ""))
        if not page.get("IsTruncated"):
            return
        token = page.get("NextContinuationToken")
        if not token:
            raise CorruptDataError("the listing says it is truncated but gives no continuation token", path=url)


def list_s3(where: Any, pattern: str) -> Listing:
    """``Location.list`` of an ``s3://`` prefix or brace pattern (see the module): one listing of the base, the
    spelled names looked up in it."""
    source = where.text
    if spells_files(source, pattern):
        base, wanted = spelled_base(expand_braces(source), source)
    else:
        base, wanted = source.rstrip("/"), None
    listed, refused = {}, []
    for rel, size, etag, modified in list_objects(base, where.storage_options):
        if wanted is None:
            if not fnmatch.fnmatchcase(rel, pattern):
                continue
            try:
                check_shard_path(rel, what="tar")
            except ManifestError as exc:  # never read; its key is shown escaped (repr), so it stays one line
                refused.append((repr(rel)[1:-1], f"{exc.reason}: its object is not read"))
                continue
        listed[rel] = (size, {"etag": etag, "last_modified": modified})
    names = sorted(listed) if wanted is None else wanted
    if not names:
        raise MissingInputError(f"holds no {_things(pattern, 'objects')}" + (
            f" usable as shard names ({refused[0][1]})" if refused else ""), path=source)
    base_at, files = where.at(base), []
    for rel in names:
        if rel not in listed:
            raise MissingInputError(f"no such object (from the pattern {source})", path=f"{base}/{rel}")
        files.append(Listed(rel, base_at.child(rel, where=source, what="tar"), *listed[rel]))
    return Listing(base_at, tuple(sorted(files, key=lambda f: f.rel)), tuple(refused))


def list_http(where: Any, pattern: str) -> Listing:
    """``Location.list`` of an ``http(s)`` brace pattern or URL: each named file asked for its state (HTTP has no
    listing)."""
    from shards.transport.remote import object_state

    source = where.text
    if not spells_files(source, pattern):
        raise InputError("an http(s) source is a .tar URL or a brace pattern of them (HTTP has no listing)",
                         path=source)
    base, names = spelled_base(expand_braces(source), source)
    if url_origin(base) is None:
        raise InputError("is not an http(s) URL with a host", path=source)
    base_at, files = where.at(base), []
    for rel in names:
        file = base_at.child(rel)
        size, etag, modified = object_state(file.text, limits=file.limits())
        if size is None:  # the one bound on what its streaming read may copy
            raise InputError("the server gives no Content-Length for it: its size cannot be checked",
                             path=file.text)
        files.append(Listed(rel, file, size, {"etag": etag, "last_modified": modified}))
    return Listing(base_at, tuple(sorted(files, key=lambda f: f.rel)), ())
