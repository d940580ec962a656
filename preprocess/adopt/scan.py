"""One source tar indexed: its size, version (mtime, or ETag and Last-Modified) and sha256, the rows of the
samples the strict parser accepts, and the samples it refuses with their reasons.

The tar is read by the pack source's scan (``preprocess.pack.sources.tars.judged_samples``: our strict tar parser,
headers and label/``.json`` members only, images passed over by a seek), so adopting and packing accept and refuse
the same samples for the same reasons. It is opened read-only through the one door and never written; a local
tar's size and mtime are taken before and after, and a tar that changed meanwhile is refused (an index of bytes
that moved would point at the wrong samples). A remote tar is scanned from the copy its one streaming read staged
under the index folder (``preprocess.adopt.sources.stage``, which hashed it and held it to its listed size).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from preprocess.adopt.sources import SourceTar, local_version
from preprocess.pack.sources.members import SourceFields, member_path
from preprocess.pack.sources.tars import Skips, judged_samples
from shards.atomic import atomic_output, sha256_file
from shards.door.bounded_read import parse_json
from shards.errors import ChecksumError

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

    def rows(self) -> Iterator[dict[str, Any]]:
        """The part file's rows, in tar order (our own file, written by this run; read through the door)."""
        with open(self.part, "rb") as handle:
            for line in handle:
                yield parse_json(line)


def scalar_meta(raw: bytes | None) -> dict[str, Any]:
    """The scalar fields of a ``.json`` member (strings, finite numbers, booleans) for the column index; anything
    that is not a JSON object gives none (webdataset reads the sample all the same, so it is not refused)."""
    if not raw:
        return {}
    try:
        value = parse_json(raw)
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {name: item for name, item in value.items()
            if name not in RESERVED and isinstance(item, (str, bool, int, float))
            and not (isinstance(item, float) and not math.isfinite(item))}


def scan_tar(tar: SourceTar, fields: SourceFields, first_tar: dict[str, str], max_bytes: int, part: Path,
             skips: Skips, *, staged: tuple[Path, int, str] | None = None) -> ScannedTar:
    """Index ``tar`` into the part file ``part``: the local tar itself, or (``staged``: its copy's path, size and
    sha256) a remote tar's staged copy; ``first_tar`` (key -> tar) gains the keys accepted here, ``skips`` the
    samples refused (the first ``MAX_LISTED_SKIPS`` of a run by name, the rest counted in one line per tar, as
    ``pack-shards`` lists them)."""
    rel = tar.rel
    if staged is None:
        path = str(tar.location.path)
        before = local_version(path)
        scanned = ScannedTar(rel, before[0], before[1], sha256_file(path), part)
    else:
        path = str(staged[0])
        scanned = ScannedTar(rel, staged[1], dict(tar.version), staged[2], part)
    _walk_into(scanned, path, fields, first_tar, max_bytes, part, skips)
    if staged is None and local_version(path) != before:
        raise ChecksumError("changed while it was being indexed; index it again once it is complete", path=path)
    return scanned


def _walk_into(scanned: ScannedTar, path: str, fields: SourceFields, first_tar: dict[str, str], max_bytes: int,
               part: Path, skips: Skips) -> None:
    """The strict scan of the tar at ``path``: accepted rows into ``part``, refused samples into ``skips``."""
    rel = scanned.rel
    with atomic_output(part) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for found in judged_samples(path, fields, first_tar, max_bytes, keep_json=True):
            scanned.seen += 1
            if found.problem is not None:
                scanned.refused += 1
                skips.add(rel if found.key is None else member_path(rel, found.key), found.problem)
                continue
            first_tar[found.key] = rel
            scanned.count += 1
            scanned.classes.add(found.label)
            handle.write(json.dumps({"key": found.key, "start": found.start, "end": found.end, "class": found.label,
                                     "meta": scalar_meta(found.json)}, ensure_ascii=False) + "\n")
    skips.end_of_tar(rel)
