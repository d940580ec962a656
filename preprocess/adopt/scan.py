"""One source tar indexed: its size, version (mtime, or ETag and Last-Modified) and sha256, the rows of the
samples the strict parser accepts, and the samples it refuses with their reasons.

The tar is read by the pack source's scan (``preprocess.pack.sources.tars.judged_samples``: our strict tar parser,
headers and label/``.json`` members only, images passed over by a seek), so adopting and packing accept and refuse
the same samples for the same reasons. It is opened read-only through the one door and never written; a local
tar's size and mtime are taken before and after, and a tar that changed meanwhile is refused (an index of bytes
that moved would point at the wrong samples). A remote tar is scanned from the copy its one streaming read staged
under the index folder (``preprocess.adopt.sources.stage``, which hashed it and held it to its listed size).

Beside the walk, a second forward read of the same file records each accepted row's key and checksum
(``shards.formats.adopted.read_row``, the reader's own definition, so what is recorded is what is checked) and
hashes every byte: the tar's sha256 comes from that one pass. A key it meets other than the walk's means the tar
changed under the scan. A ``.json`` member gives at most ``MAX_SAMPLE_FIELDS`` scalar fields (the column index
bounds distinct fields across samples: ``shards.formats.column_writer``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from preprocess.adopt.sources import local_version
from preprocess.pack.sources.members import SourceFields, member_path
from preprocess.pack.sources.tars import Skips, judged_samples
from shards.atomic import atomic_output
from shards.door.bounded_read import parse_json
from shards.errors import ChecksumError
from shards.formats.adopted import read_row
from shards.formats.column_writer import MAX_SAMPLE_FIELDS
from shards.formats.tarheader import READ_BUFFER, ByteSource
from shards.formats.tarseek import open_tar
from shards.transport.listing import Listed

RESERVED = ("key", "label", "class")  # the column index's own fields


@dataclass
class ScannedTar:
    """What the index keeps in memory of one scanned tar; its accepted samples (key, start, end, class name, the
    ``.json`` member's scalars) are in its part file (``part``, JSON Lines), so memory does not grow with the
    samples of a source; the refused ones are listed in the run's ``Skips``. ``seen``: samples met, accepted or
    not."""

    rel: str
    bytes: int
    version: Mapping[str, Any]
    sha256: str
    part: Path
    count: int = 0
    classes: set[str] = field(default_factory=set)
    refused: int = 0
    seen: int = 0
    dropped_fields: int = 0  # scalar .json fields past MAX_SAMPLE_FIELDS of a sample

    def rows(self) -> Iterator[dict[str, Any]]:
        """The part file's rows, in tar order (our own file, written by this run; read through the door)."""
        with open(self.part, "rb") as handle:
            for line in handle:
                yield parse_json(line)


def scalar_meta(raw: bytes | None) -> tuple[dict[str, Any], int]:
    """The first ``MAX_SAMPLE_FIELDS`` scalar fields of a ``.json`` member (strings, finite numbers, booleans) for
    the column index, and how many more were dropped; anything that is not a JSON object gives none (webdataset
    reads the sample all the same, so it is not refused)."""
    if not raw:
        return {}, 0
    try:
        value = parse_json(raw)
    except ValueError:
        return {}, 0
    if not isinstance(value, dict):
        return {}, 0
    scalars = [(name, item) for name, item in value.items()
               if name not in RESERVED and isinstance(item, (str, bool, int, float))
               and not (isinstance(item, float) and not math.isfinite(item))]
    return dict(scalars[:MAX_SAMPLE_FIELDS]), max(0, len(scalars) - MAX_SAMPLE_FIELDS)


def scan_tar(tar: Listed, fields: SourceFields, first_tar: dict[str, str], max_bytes: int, part: Path,
             skips: Skips, *, staged: tuple[Path, int, str] | None = None) -> ScannedTar:
    """Index ``tar`` into the part file ``part``: the local tar itself, or (``staged``: its copy's path, size and
    sha256) a remote tar's staged copy; ``first_tar`` (key -> tar) gains the keys accepted here, ``skips`` the
    samples refused (the first ``MAX_LISTED_SKIPS`` of a run by name, the rest counted in one line per tar, as
    ``pack-shards`` lists them)."""
    rel = tar.rel
    if staged is None:
        path = str(tar.location.path)
        before = local_version(path)
        scanned = ScannedTar(rel, before[0], before[1], "", part)
    else:
        path = str(staged[0])
        scanned = ScannedTar(rel, staged[1], dict(tar.version), staged[2], part)
    digest = _walk_into(scanned, path, fields, first_tar, max_bytes, part, skips)
    if (staged is None and local_version(path) != before) or (staged is not None and digest != staged[2]):
        raise ChecksumError("changed while it was being indexed; index it again once it is complete", path=path)
    scanned.sha256 = digest
    return scanned


def _walk_into(scanned: ScannedTar, path: str, fields: SourceFields, first_tar: dict[str, str], max_bytes: int,
               part: Path, skips: Skips) -> str:
    """The strict scan of the tar at ``path``: accepted rows (with their checksums) into ``part``, refused
    samples into ``skips``; the sha256 of its bytes."""
    rel = scanned.rel
    with atomic_output(part) as tmp, open(tmp, "w", encoding="utf-8") as handle, open_tar(path) as tar:
        reader = ByteSource(tar, path, total=None, hashing=True)
        for found in judged_samples(path, fields, first_tar, max_bytes, keep_json=True):
            scanned.seen += 1
            if found.problem is not None:
                scanned.refused += 1
                skips.add(rel if found.key is None else member_path(rel, found.key), found.problem)
                continue
            reader.padding = 0
            reader.skip(found.start - reader.offset)
            key, _, checksum = read_row(reader, found.end)
            if key != found.key:
                raise ChecksumError("changed while it was being indexed; index it again once it is complete",
                                    path=path)
            meta, dropped = scalar_meta(found.json)
            scanned.dropped_fields += dropped
            first_tar[found.key] = rel
            scanned.count += 1
            scanned.classes.add(found.label)
            handle.write(json.dumps({"key": found.key, "start": found.start, "end": found.end, "class": found.label,
                                     "crc": checksum, "meta": meta}, ensure_ascii=False) + "\n")
        while reader.read(READ_BUFFER):  # every byte hashed, the refused samples' and the end's too
            pass
    skips.end_of_tar(rel)
    return reader.digest.hexdigest()  # type: ignore[union-attr]  # a hashing source has one
