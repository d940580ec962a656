"""Scanning a source into labelled source samples: ``scan_source`` asks the registry
(``preprocess.pack.sources.registry``) which kind the input is, refuses options that kind does not read, and runs
that kind's scan; ``SourceScan`` is what every later stage (plan, pack, append) is given.

Scanning only lists and stats files: nothing is decoded and nothing is written, so every input error is found
before the first byte of output exists. Each sample gets a key derived from its relative path alone (or, for a
kind that keeps its own keys, the key the source gave it), so the same sample gets the same key on every machine
and every rerun.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from preprocess.pack.sources.columns import NO_SPLIT, SourceSamples, as_samples, is_utf8_name, printable_name
from preprocess.pack.sources.kind import ScanRequest, SkippedSource, SourceKind
from preprocess.pack.sources.members import DEFAULT_MAX_BYTES, MemberSpec, SourceFields
from preprocess.pack.sources.registry import check_fields, recognise, source_kind
from shards.errors import InputError

__all__ = ["SourceScan", "scan_source", "check_out_outside_source"]


@dataclass(frozen=True)
class SourceScan:
    """``samples`` is a ``SourceSamples`` (columns); rows given as ``SourceSample`` tuples are stored as columns,
    relative to the base the kind's samples are relative to."""

    kind: str  # a name in the registry's SOURCE_KINDS, recorded as the manifest's ``source.kind``
    root: str
    classes: tuple[str, ...]
    samples: SourceSamples
    skipped: tuple[SkippedSource, ...] = ()
    members: MemberSpec | None = None  # how to read members of container files; None: each sample is a file

    def __post_init__(self) -> None:
        kind = self.source_kind
        base = self.root if kind.base_is_root else os.path.dirname(self.root)
        object.__setattr__(self, "samples", as_samples(self.samples, base, kept_keys=kind.kept_keys))

    @property
    def source_kind(self) -> SourceKind:
        return source_kind(self.kind)

    @property
    def files_seen(self) -> int:
        return len(self.samples) + len(self.skipped)

    @property
    def has_splits(self) -> bool:
        return bool((self.samples.column("split") != NO_SPLIT).any())


def scan_source(source: str | os.PathLike, *, allow_empty_classes: bool = False,
                fields: SourceFields | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> SourceScan:
    """Scan ``source`` as the kind the registry recognises it as. ``fields`` (where the image and label are)
    applies to the container kinds only, each reading its own; ``max_bytes`` (a shard's, ``--max-bytes``) bounds
    what a container may make a reader decode at once (a sample, a row group), judged from what it declares
    before anything is read."""
    source = os.fspath(source)
    if not is_utf8_name(source):  # the manifest and the plan record the source's path
        raise InputError("path is not valid UTF-8 (rename it, or pack from a link with a UTF-8 name)",
                         path=printable_name(source))
    request = ScanRequest(allow_empty_classes, fields or SourceFields(), max_bytes)
    kind = recognise(source)
    check_fields(kind, request.fields, str(Path(source)))
    scanned = kind.scan(source, request)
    return SourceScan(kind.name, scanned.root, scanned.classes, scanned.samples, scanned.skipped, scanned.members)


def check_out_outside_source(source: str | os.PathLike, out: str | os.PathLike) -> None:
    """Refuse an output folder that a folder source's scan would walk (the source itself or a visible folder in
    it): its shards would be packed once, then every rerun would find the output as one more class (or split).
    Hidden folders are never scanned, so ``SOURCE/.shards`` is allowed; list files name their images, so they scan
    no folder."""
    if not Path(source).is_dir():
        return
    root, target = os.path.realpath(source), os.path.realpath(out)
    if os.path.commonpath([root, target]) != root:
        return
    inside = Path(os.path.relpath(target, root)).parts
    if not any(part.startswith(".") and part != "." for part in inside):
        where = "is the source folder" if inside == (".",) else f"is inside the source folder {source}"
        raise InputError(f"--out {where}, where the next scan would take it for a class; choose a folder outside "
                         "the source", path=str(out))
