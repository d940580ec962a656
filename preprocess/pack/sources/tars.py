"""Existing WebDataset tars as a packing source: samples scanned into members, their bytes read back by the packer.

The source is a ``.tar`` path or a pattern with braces (``data/shard-{000..099}.tar``, ``{a,b}``), expanded here:
no shell is involved. A tar is untrusted input: it is read only by the project's strict tar parser
(``shards.formats.tarheader``), never extracted; links, folders and other non-regular members are passed over
(never followed); every size is checked against the bytes the file holds before anything is read, and a label
member or ``.json`` member is read only up to ``MAX_LABEL_BYTES``.

Each sample is a member ``<tar>#<key>`` whose ``offset`` is the byte where its first header starts and whose size
is its byte range, so the scan reads headers and labels only, never an image, and the packer reads each shard's
samples tar by tar, in offset order, each tar opened once. Keys are kept, as WebDataset writes them (the name
before the first dot of the member's last path part): a key must be ASCII letters, digits, ``_`` and ``-``, parts
joined by ``/`` (no ``.`` or ``..`` part, so no ``../`` can reach a key); a key that is not, a duplicate key
(another sample, in this tar or an earlier one, has it), a sample without an image member or without its label
is skipped with its reason, like a broken image (``--strict``: fatal). Damage in a tar (a bad header, a member
cut short, no end-of-archive marker) skips the rest of that tar, the sample in progress included, with the
reason; the whole samples before it are packed.

Memory follows what is kept, not what a tar declares or holds (docs/trust-model.md, "One door"): a sample larger
than ``--max-bytes`` (its members' headers and data, as their headers declare them: a sparse 3 GiB member costs a
seek) is skipped by that size, never read, and the packer reads no further than the scan measured; a sample
holding one extension twice (webdataset refuses it) or more than ``MAX_SAMPLE_MEMBERS`` members is skipped
without keeping its member list; and of the samples skipped, the first ``MAX_LISTED_SKIPS`` are named one by one
and the rest only counted, in one line per tar (a tar of a million empty members is 512 MB of headers that would
otherwise become a million manifest entries).
"""

from __future__ import annotations

import os
import re
from typing import Iterator, Mapping, NamedTuple, Sequence

from preprocess.pack.sources.members import (DEFAULT_MAX_BYTES, MemberBytes, MemberSpec, SourceFields, member_key,
                                             member_path)
from preprocess.pack.sources.columns import SamplesBuilder, SourceSample
from preprocess.pack.sources.kind import MAX_CLASS_CHARS, KindScan, ScanRequest, member_scan
from shards.door.bounded_read import open_regular_file, parse_json
from shards.errors import CorruptDataError, InputError
from shards.formats.sample import IMAGE_EXTENSIONS
from shards.formats.tarheader import ByteSource, read_member, split_member_name
from shards.transport.listing import local_files, spells_files
from shards.units import human_bytes

MAX_LABEL_BYTES = 1 << 20  # a label member or .json member is text, not data
KEY = re.compile(r"^[A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*\Z")
MAX_NAME_BYTES = 100  # a ustar header's name field: each member the packer writes must fit it
MAX_SAMPLE_MEMBERS = 1024  # members of one sample: a WebDataset sample has a handful
MAX_LISTED_SKIPS = 1000  # skipped samples named one by one in the scan (and the manifest); the rest are counted
# Members whose extension the packer writes itself (its image, label and metadata): a source member of that
# extension is kept as ``<key>.source.<ext>``.
OWN_EXTENSIONS = frozenset({"cls", "json", *IMAGE_EXTENSIONS})


def is_tar_pattern(source: str) -> bool:
    """A ``.tar`` path, or a brace pattern of them."""
    return spells_files(source, "*.tar")


def scan_tars(source: str, request: ScanRequest) -> KindScan:
    pattern = os.path.join(os.getcwd(), source)  # not normalised: ``..`` after a brace must stay
    return member_scan(pattern, scan_tar_source(pattern, request.fields, max_bytes=request.max_bytes))


def tar_files(pattern: str) -> tuple[str, list[tuple[str, str]]]:
    """The base folder and ``(absolute path, path relative to it)`` of every tar the pattern names (the location
    layer's rule for spelled names, ``shards.transport.listing``)."""
    return local_files(pattern)


class _Sample:
    """A sample's members as the scan walks them: where each starts and how big it is, and the label's bytes."""

    def __init__(self, key: str, start: int):
        self.key, self.start, self.end = key, start, start
        self.exts: list[str] = []
        self.texts: dict[str, bytes | None] = {}  # the label member / .json member (None: too large)
        self.problem: str | None = None  # found while walking: its members are no longer recorded

    def add(self, ext: str) -> None:
        if self.problem is not None:
            return
        if ext in self.exts:
            self.problem = f"duplicate member {self.key[:80]}.{ext[:40]} (a sample holds each extension once)"
        elif len(self.exts) >= MAX_SAMPLE_MEMBERS:
            self.problem = f"more than {MAX_SAMPLE_MEMBERS} members"
        else:
            self.exts.append(ext)
            return
        self.exts, self.texts = [], {}


def _walk(path: str, text_exts: set[str]) -> Iterator[_Sample | CorruptDataError]:
    """The samples of one tar in order, members grouped by key; the first damage is yielded last. Only headers and
    label members are read: every other member is passed over by a seek."""
    with open_regular_file(path) as handle:
        source = ByteSource(handle, path, total=os.fstat(handle.fileno()).st_size, hashing=False)
        current: _Sample | None = None
        try:
            while (member := read_member(source)) is not None:
                name, size = member
                key, ext = split_member_name(name)
                if current is None or key != current.key:
                    if current is not None:
                        yield current
                    current = _Sample(key, source.member_start)
                current.add(ext)
                text = current.problem is None and ext.lower() in text_exts
                if text and size <= MAX_LABEL_BYTES:
                    current.texts[ext.lower()] = source.read(size, key=key)
                else:
                    if text:
                        current.texts[ext.lower()] = None  # too large to be a label
                    source.skip(size)
                current.end = source.offset
        except CorruptDataError as damage:
            yield damage
            return
        if source.offset == source.header_start and source.offset > 0:  # no end-of-archive marker: cut short
            yield CorruptDataError(f"no end-of-archive marker after byte {source.offset}: cut short?", path=path)
        elif current is not None:
            yield current


def _label(sample: _Sample, fields: SourceFields) -> tuple[str | None, str | None]:
    """``(class name, None)`` or ``(None, skip reason)``."""
    ext = "json" if fields.label_field is not None else (fields.label_member or "cls").lower()
    if ext not in sample.texts:
        return None, f"no .{ext} member (its label)"
    raw = sample.texts[ext]
    if raw is None:
        return None, f".{ext} member larger than {MAX_LABEL_BYTES} bytes"
    try:
        text = raw.decode("utf-8").strip()
        value = parse_json(text).get(fields.label_field) if fields.label_field is not None else text
    except (UnicodeDecodeError, ValueError, AttributeError):  # JSONError is a ValueError
        return None, f".{ext} member is not " + ("a JSON object" if fields.label_field else "UTF-8 text")
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        return None, (f"no label field {fields.label_field!r} (a string or an integer) in its .json member"
                      if fields.label_field is not None else f"empty .{ext} member (its label)")
    if len(str(value)) > MAX_CLASS_CHARS:
        return None, f"label longer than {MAX_CLASS_CHARS} characters"
    return str(value), None


def output_ext(ext: str) -> str:
    """The extension a source member is kept under: ``source.<ext>`` when the packer writes its own of that name."""
    return f"source.{ext}" if ext.lower() in OWN_EXTENSIONS else ext


def _problem(sample: _Sample, first_tar: dict[str, str], max_bytes: int) -> str | None:
    if not KEY.match(sample.key):
        return f"bad key {sample.key[:80]!r} (keys are ASCII letters, digits, _ and -, parts joined by /)"
    if sample.problem is not None:
        return sample.problem
    if sample.end - sample.start > max_bytes:
        return (f"too large: {human_bytes(sample.end - sample.start)} of members, more than --max-bytes "
                f"({human_bytes(max_bytes)})")
    longest = max(len(f"{sample.key}.{output_ext(ext)}".encode("utf-8", "surrogateescape")) for ext in sample.exts)
    if longest > MAX_NAME_BYTES:
        return f"member names too long ({longest} bytes; a tar shard's names hold {MAX_NAME_BYTES})"
    clash = _kept_twice(sample.exts)
    if clash is not None:
        return (f"members .{clash[0]} and .{clash[1]} would both be kept as .{output_ext(clash[1])} (a tar that "
                "holds a name twice is refused by its readers)")
    if sample.key in first_tar:
        return f"duplicate key (first in {first_tar[sample.key]})"
    if not any(ext.lower() in IMAGE_EXTENSIONS for ext in sample.exts):
        return f"no image member (found: {', '.join(sorted(set(sample.exts))) or 'nothing'})"
    return None


def _kept_twice(exts: Sequence[str]) -> tuple[str, str] | None:
    """Two members whose kept names would be one (``.json`` and ``.source.json``: the first is kept as the second;
    names that differ only in case count as one too), or None. The image member is not kept as an extra."""
    image = next((ext for ext in IMAGE_EXTENSIONS if any(e.lower() == ext for e in exts)), None)
    seen: dict[str, str] = {}
    skipped_image = False
    for ext in exts:
        if not skipped_image and ext.lower() == image:
            skipped_image = True
            continue
        kept = output_ext(ext).casefold()
        if kept in seen:
            return seen[kept], ext
        seen[kept] = ext
    return None


class Skips:
    """Skipped samples and why: the first ``MAX_LISTED_SKIPS`` named one by one, the rest counted and named in one
    line per tar, so neither memory nor the manifest grows with the members a tar holds."""

    def __init__(self) -> None:
        self.listed: list[tuple[str, str]] = []
        self.unlisted, self.first_unlisted = 0, ""

    def add(self, rel_path: str, reason: str) -> None:
        if len(self.listed) < MAX_LISTED_SKIPS:
            self.listed.append((rel_path, reason))
            return
        self.unlisted += 1
        self.first_unlisted = self.first_unlisted or f"{rel_path}: {reason}"

    def end_of_tar(self, rel: str) -> None:
        if self.unlisted:
            self.listed.append((rel, f"not listed one by one: {self.unlisted:,} more samples skipped in this tar "
                                     f"(the first: {self.first_unlisted})"))
            self.unlisted, self.first_unlisted = 0, ""


class Judged(NamedTuple):
    """One sample of a tar as the scan judged it: where its members start and end, its class name and ``.json``
    member (when asked for), or why it is skipped (``key`` None: damage, the rest of the tar skipped)."""

    key: str | None
    start: int
    end: int
    label: str | None
    problem: str | None
    json: bytes | None = None


def judged_samples(path: str, fields: SourceFields, first_tar: Mapping[str, str], max_bytes: int, *,
                   keep_json: bool = False) -> Iterator[Judged]:
    """Every sample of the tar at ``path`` in order, with its label or its skip reason; ``first_tar``: the tar
    holding each key accepted so far (a key seen there again is a duplicate; the caller records the accepted
    ones). ``keep_json``: read each sample's ``.json`` member too (up to ``MAX_LABEL_BYTES``), for its metadata."""
    label_exts = {"json"} if fields.label_field is not None else {(fields.label_member or "cls").lower()}
    for found in _walk(path, label_exts | ({"json"} if keep_json else set())):
        if isinstance(found, CorruptDataError):
            yield Judged(None, 0, 0, None, f"damaged tar, the rest of it skipped ({found.reason})")
            continue
        problem = _problem(found, first_tar, max_bytes)
        label, label_problem = _label(found, fields) if problem is None else (None, None)
        yield Judged(found.key, found.start, found.end, label, problem or label_problem, found.texts.get("json"))


def scan_tar_source(pattern: str, fields: SourceFields, *, max_bytes: int = DEFAULT_MAX_BYTES):
    """Every sample of every tar as a member: ``(classes, samples, skipped pairs, MemberSpec)``. A sample of more
    than ``max_bytes`` (``--max-bytes``; its headers and data, as declared) is skipped unread: the packer holds a
    sample's bytes whole, and a shard's at most about that much."""
    base, tars = tar_files(pattern)
    builder = SamplesBuilder(base, members=True, kept_keys=True)
    numbers: dict[str, int] = {}
    skips = Skips()
    first_tar: dict[str, str] = {}
    for path, rel in tars:
        mtime_ns = os.stat(path).st_mtime_ns
        for found in judged_samples(path, fields, first_tar, max_bytes):
            if found.problem is not None:
                skips.add(rel if found.key is None else member_path(rel, found.key), found.problem)
                continue
            rel_path = member_path(rel, found.key)
            label = found.label
            first_tar[found.key] = rel
            builder.add(rel_path, numbers.setdefault(label, len(numbers)), None, found.end - found.start,
                        mtime_ns, found.start)
        skips.end_of_tar(rel)
    classes = tuple(sorted(numbers))
    index_of = {name: i for i, name in enumerate(classes)}
    builder.renumber_labels([index_of[name] for name in numbers])
    return classes, builder.build(), skips.listed, MemberSpec("tar", max_bytes=max_bytes)


def fetch_tar_members(spec: MemberSpec, container: str, wanted: Sequence[tuple[int, SourceSample]]
                      ) -> Iterator[tuple[int, MemberBytes]]:
    """The members of each wanted sample of one tar, read in offset order from one open file; a sample whose
    bytes no longer read as scanned (the tar changed, or is damaged there) is a problem, not an error."""
    try:
        handle = open_regular_file(container)
    except InputError as exc:
        for position, _ in wanted:
            yield position, MemberBytes(None, f"cannot read its tar ({exc.reason})")
        return
    with handle:
        info = os.fstat(handle.fileno())
        for position, sample in sorted(wanted, key=lambda item: item[1].offset):
            if info.st_mtime_ns != sample.mtime_ns:
                yield position, MemberBytes(None, "its tar changed since the scan")
                continue
            handle.seek(sample.offset)
            source = ByteSource(handle, container, total=info.st_size, hashing=False, offset=sample.offset)
            try:
                yield position, _sample_members(source, member_key(sample.rel_path), sample.offset + sample.size)
            except CorruptDataError as exc:
                yield position, MemberBytes(None, f"damaged tar ({exc.reason})")


def _sample_members(source: ByteSource, key: str, end: int) -> MemberBytes:
    parts: list[tuple[str, bytes]] = []
    while source.offset + source.padding < end and (member := read_member(source)) is not None:
        name, size = member
        member_key_, ext = split_member_name(name)
        if member_key_ != key or source.offset + size > end:  # never read past what the scan measured
            return MemberBytes(None, "its tar changed since the scan")
        parts.append((ext, source.read(size, key=key)))
    image_ext = next((ext for ext in IMAGE_EXTENSIONS if any(e.lower() == ext for e, _ in parts)), None)
    if image_ext is None:
        return MemberBytes(None, "its tar changed since the scan")
    image_index = next(i for i, (e, _) in enumerate(parts) if e.lower() == image_ext)
    extra = tuple((output_ext(ext), data) for i, (ext, data) in enumerate(parts) if i != image_index)
    return MemberBytes(parts[image_index][1], None, None, extra)


