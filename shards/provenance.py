"""Where a packed dataset came from: the source ``pack-shards`` read (its kind, its root, the files it saw) and
every file it skipped, with the reason.

Data errors are data: a file refused at scan time or while packing is recorded here, in the manifest's
``source``, so the summary and ``shards report`` can say what was left out and why, instead of a warning that
scrolled past. Read through ``shards.door.shape`` like the rest of a manifest (``shards.manifest``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shards.door.shape import as_int, as_list, as_object, as_str, field as get


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason}

    @classmethod
    def from_dict(cls, data: Any, where: str | None = None, what: str = "skipped") -> "SkippedFile":
        data = as_object(data, what, where=where)
        return cls(as_str(get(data, "path", what, where=where), f"{what}.path", max_len=1 << 16, where=where),
                   as_str(get(data, "reason", what, where=where), f"{what}.reason", max_len=1 << 16, where=where))


@dataclass(frozen=True)
class SourceInfo:
    kind: str  # "imagefolder", "imagefolder-splits", "csv", "jsonl"
    root: str
    files_seen: int
    skipped: tuple[SkippedFile, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "root": self.root,
            "files_seen": self.files_seen,
            "skipped": [s.to_dict() for s in self.skipped],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str | None = None, what: str = "source") -> "SourceInfo":
        data = as_object(data, what, where=where)
        skipped = as_list(get(data, "skipped", what, default=[], where=where), f"{what}.skipped", where=where)
        return cls(
            kind=as_str(get(data, "kind", what, where=where), f"{what}.kind", where=where),
            root=as_str(get(data, "root", what, where=where), f"{what}.root", max_len=1 << 16, where=where),
            files_seen=as_int(get(data, "files_seen", what, where=where), f"{what}.files_seen", where=where),
            skipped=tuple(SkippedFile.from_dict(s, where, f"{what}.skipped[{i}]") for i, s in enumerate(skipped)),
        )
