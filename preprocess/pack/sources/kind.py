"""What a kind of source is to the registry: how it is recognised, what its scan is asked, what it gives back.

Every kind (``preprocess.pack.sources.registry`` lists them) is a ``SourceKind``: the name the manifest records as
``source.kind``, a test that recognises the kind's input from its path, and a scan that lists the input's samples
(nothing decoded, nothing written, so every input error is found before the first byte of output exists). The
contract lives here, below each kind's module and below the registry, so a new kind is one module and one registry
entry with no import loop, and nothing above the registry asks which kind a source is by its name.

Also here, what the scans share: a file or member found but not packable is a ``SkippedSource`` with its reason
(in ``dataset.json``'s ``source.skipped``; ``--strict`` makes it fatal), never an error of the whole source; and
the two file kinds (trees and lists) stat each file the same way. Only regular files are packed (symlinks to them
are followed); the packer checks again when it opens the file (``validate.read_file``), since a file can be
swapped after the scan.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

from preprocess.pack.sources.columns import SamplesBuilder, SourceSamples, is_utf8_name, printable_name
from preprocess.pack.sources.members import DEFAULT_MAX_BYTES, MemberSpec, SourceFields, too_large
from shards.door.bounded_read import not_regular_reason
from shards.errors import InputError

log = logging.getLogger("shardcache.sources")

MAX_CLASS_CHARS = 256  # a class name (a label), as the manifest and the plan record it: text, not data


class SkippedSource(NamedTuple):
    """A file found in the source that cannot be packed (not a regular file, a broken link), and why."""

    rel_path: str
    reason: str


@dataclass(frozen=True)
class ScanRequest:
    """What ``scan_source`` was asked, handed to every kind's scan alike; each reads what applies to it."""

    allow_empty_classes: bool = False
    fields: SourceFields = field(default_factory=SourceFields)
    # A shard's ``--max-bytes``: what a container may make a reader decode at once, judged before it is read.
    max_bytes: int = DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class KindScan:
    """What a kind's scan found: ``root`` as the manifest records it, classes sorted, samples as columns."""

    root: str
    classes: tuple[str, ...]
    samples: SourceSamples
    skipped: tuple[SkippedSource, ...] = ()
    members: MemberSpec | None = None  # how to read members of container files; None: each sample is a file


@dataclass(frozen=True)
class SourceKind:
    """One kind of source, as the registry lists it."""

    name: str  # the manifest's ``source.kind``
    title: str  # how messages and ``pack-shards --help`` name it
    looks_like: str  # what input it is recognised from, for the error an unrecognised source gets
    recognise: Callable[[str], bool]  # from the path (or pattern) alone; False for a path that does not exist
    scan: Callable[[str, ScanRequest], KindScan]
    # The ``SourceFields`` it reads; another one given (not its default) is refused, never silently ignored.
    fields: frozenset[str] = frozenset()
    # Relative paths are relative to the root itself (a tree), else to the folder the root is in.
    base_is_root: bool = False
    # Samples keep the keys the source gave them (checked by the scan), not keys derived from their paths.
    kept_keys: bool = False
    # Samples carry members besides the image and label, which only some storages keep.
    extra_members: bool = False


def found(root: str, classes: tuple[str, ...], samples: SourceSamples, skipped: Iterable[tuple[str, str]],
          members: MemberSpec | None = None) -> KindScan:
    """A kind's scan, its skipped files sorted; each is logged at debug level only, since the packer's one
    warning line counts them by reason (``preprocess.pack.packer.log_skipped``)."""
    listed = tuple(sorted(SkippedSource(*item) for item in skipped))
    for item in listed:
        log.debug("%s: skipping %s: %s", root, item.rel_path, item.reason)
    return KindScan(root, classes, samples, listed, members)


def member_scan(root: str, scanned: tuple) -> KindScan:
    """A container source's scan from what its scanner found: ``(classes, samples, skipped pairs, spec)``."""
    classes, samples, skipped, spec = scanned
    result = found(root, classes, samples, skipped, spec)
    if not len(result.samples):
        raise InputError("holds no packable samples" + (f" ({len(result.skipped)} skipped: {result.skipped[0].reason})"
                                                        if result.skipped else ""), path=root)
    return result


def stat_file(abs_path: str, rel_path: str) -> os.stat_result | SkippedSource:
    """The file's stat, or why it is skipped. Never opens the file: opening a FIFO would block."""
    try:
        info = os.stat(abs_path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return SkippedSource(rel_path, "symbolic link loop")
        if isinstance(exc, FileNotFoundError) and os.path.islink(abs_path):
            return SkippedSource(rel_path, f"dangling symbolic link (to {os.readlink(abs_path)!r})")
        return SkippedSource(rel_path, f"cannot stat ({exc.strerror or exc})")
    reason = not_regular_reason(info.st_mode)
    return info if reason is None else SkippedSource(rel_path, reason)


def add_file(builder: SamplesBuilder, skipped: list[SkippedSource], rel_path: str, label: int,
             split: str | None, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """One file of a tree or list: a sample if it is a regular file of at most ``max_bytes`` (``--max-bytes``: the
    packer holds a file whole, so a larger one, a sparse 3 GiB file, is skipped by its size, unread), else a
    skipped file with its reason."""
    if not is_utf8_name(rel_path):  # one file from an old archive, named in Latin-1: the rest still packs
        skipped.append(SkippedSource(printable_name(rel_path), "file name is not valid UTF-8 (rename it)"))
        return
    info = stat_file(os.path.join(builder.base, rel_path), rel_path)
    if isinstance(info, SkippedSource):
        skipped.append(info)
    elif info.st_size > max_bytes:
        skipped.append(SkippedSource(rel_path, too_large(info.st_size, max_bytes)))
    else:
        builder.add(rel_path, label, split, info.st_size, info.st_mtime_ns)
