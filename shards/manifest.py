"""The manifests: the versioned contract between the stages and the commit marker of each output folder.

``dataset.json`` describes image shards (written by ``pack-shards``); ``features.json`` describes feature shards
(written by ``precompute-features``). Both are written last and atomically; a folder without one is unfinished.
Readers check ``format`` and ``version`` and refuse what they do not know. Unknown extra keys are kept in
``extra`` so a newer minor writer does not break an older reader.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping

from shards.atomic import write_json_atomic
from shards.bounded_read import read_json_file
from shards.errors import ManifestError, MissingInputError
from shards.formats.locations import check_dataset_dir, check_shard_path

TOOL = "shardcache 0.1.0"
DATASET_FORMAT = "shardcache.dataset"
FEATURES_FORMAT = "shardcache.features"
DATASET_FILE = "dataset.json"
FEATURES_FILE = "features.json"
VERSION = 1


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class ShardInfo:
    """One shard file, relative to the manifest's folder."""

    path: str
    samples: int
    bytes: int
    sha256: str
    # Feature shards name the image shard they are aligned with, and its checksum when computed.
    source: str | None = None
    source_sha256: str | None = None
    # Tar shards packed with a per-sample byte index name its sidecar (``shards.formats.tarindex``) and checksum;
    # older datasets have neither and are read by scanning.
    index: str | None = None
    index_sha256: str | None = None
    # Samples of each class in this shard, indexed like the manifest's ``classes``, so a subset by class can skip
    # whole shards without reading them; None for shards packed before it was recorded, and for regression tables.
    class_counts: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"path": self.path, "samples": self.samples, "bytes": self.bytes, "sha256": self.sha256}
        for name in ("source", "source_sha256", "index", "index_sha256"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.class_counts is not None:
            out["class_counts"] = list(self.class_counts)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str | None = None,
                  url_origins: Iterable[str] = ()) -> "ShardInfo":
        """Checks ``path`` (and ``source``) are shard names confined to the manifest's folder; see
        ``shards.formats.locations.check_shard_path`` (``url_origins``: where shard URLs may point)."""
        source = data.get("source")
        index = data.get("index")
        index_sha256 = data.get("index_sha256")
        return cls(
            path=check_shard_path(data["path"], where=where, url_origins=url_origins),
            samples=int(data["samples"]),
            bytes=int(data["bytes"]),
            sha256=str(data["sha256"]),
            source=None if source is None else check_shard_path(source, where=where),
            source_sha256=data.get("source_sha256"),
            index=None if index is None else check_shard_path(index, where=where),
            index_sha256=None if index_sha256 is None else str(index_sha256),
            class_counts=cls._parse_class_counts(data.get("class_counts"), int(data["samples"])),
        )

    @staticmethod
    def _parse_class_counts(value: Any, samples: int) -> tuple[int, ...] | None:
        """Absent (None), or a list of non-negative ints summing to the shard's ``samples``; a ValueError
        otherwise, which the manifest readers turn into one ``ManifestError`` line."""
        if value is None:
            return None
        # Set and min over the list run in C: at 1,000 classes x 1,280 shards a generator over every count was
        # most of the time ``open_dataset`` spent before its first batch. ``type(c) is int`` refuses bools.
        if not isinstance(value, list) or not set(map(type, value)) <= {int} or (value and min(value) < 0):
            raise ValueError(f"shard class_counts {value!r} is not a list of non-negative integers")
        if sum(value) != samples:
            raise ValueError(f"shard class_counts {value!r} sum to {sum(value)}, but the shard has {samples} "
                             "samples")
        return tuple(value)


@dataclass(frozen=True)
class SplitInfo:
    samples: int
    class_counts: tuple[int, ...]
    shards: tuple[ShardInfo, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "class_counts": list(self.class_counts),
            "shards": [s.to_dict() for s in self.shards],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str | None = None,
                  url_origins: Iterable[str] = ()) -> "SplitInfo":
        return cls(
            samples=int(data["samples"]),
            class_counts=tuple(int(c) for c in data["class_counts"]),
            shards=tuple(ShardInfo.from_dict(s, where, url_origins) for s in data["shards"]),
        )

    @property
    def shard_sizes(self) -> list[int]:
        return [s.samples for s in self.shards]


@dataclass(frozen=True)
class SkippedFile:
    path: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason}


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
    def from_dict(cls, data: Mapping[str, Any]) -> "SourceInfo":
        return cls(
            kind=str(data["kind"]),
            root=str(data["root"]),
            files_seen=int(data["files_seen"]),
            skipped=tuple(SkippedFile(str(s["path"]), str(s["reason"])) for s in data.get("skipped", [])),
        )


def _check_header(data: Mapping[str, Any], expected_format: str, where: str) -> None:
    if not isinstance(data, Mapping):
        raise ManifestError("not a JSON object", path=where)
    fmt = data.get("format")
    if fmt != expected_format:
        raise ManifestError(f"format is {fmt!r}, expected {expected_format!r}", path=where)
    version = data.get("version")
    if version != VERSION:
        raise ManifestError(
            f"manifest version {version!r} is not supported by {TOOL} (knows version {VERSION}); "
            "upgrade shardcache or repack",
            path=where,
        )


_COMMON_KEYS = frozenset({"format", "version", "storage", "classes", "splits", "created", "tool"})


class _ManifestBase:
    """What both manifests share: the header, storage, classes and splits, provenance, saving. A subclass names its
    ``FORMAT`` and ``FILE`` and (de)serialises only its own fields (``_body``, ``_parse_body``); unknown keys are
    kept in ``extra`` so a newer minor writer does not break an older reader."""

    FORMAT: ClassVar[str]
    FILE: ClassVar[str]

    def _body(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def _parse_body(cls, data: Mapping[str, Any], where: str) -> dict[str, Any]:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update({"format": self.FORMAT, "version": VERSION, "storage": self.storage, "classes": list(self.classes),
                    "splits": {name: split.to_dict() for name, split in self.splits.items()}, **self._body(),
                    "created": self.created, "tool": self.tool})
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str | None = None, *, url_origins: Iterable[str] = ()):
        """``url_origins``: origins (``scheme://host[:port]``) whose ``http(s)`` shard URLs are followed: a remote
        manifest's own, or ones the caller explicitly allows. Any other URL or scheme is refused."""
        where = cls.FILE if where is None else where
        _check_header(data, cls.FORMAT, where)
        origins = tuple(url_origins)
        try:
            body = cls._parse_body(data, where)
            known = _COMMON_KEYS | set(body)
            return cls(
                storage=str(data["storage"]),
                classes=tuple(str(c) for c in data["classes"]),
                splits={name: SplitInfo.from_dict(s, where, origins) for name, s in data["splits"].items()},
                created=str(data.get("created", "")),
                tool=str(data.get("tool", "")),
                extra={k: v for k, v in data.items() if k not in known},
                **body,
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed manifest ({type(exc).__name__}: {exc})", path=where) from exc

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.classes)}

    def split(self, name: str, where: str | None = None) -> SplitInfo:
        if name not in self.splits:
            raise ManifestError(f"no split {name!r}; the manifest has {sorted(self.splits)}",
                                path=self.FILE if where is None else where)
        return self.splits[name]

    def save(self, folder: str | os.PathLike) -> Path:
        path = Path(folder) / self.FILE
        write_json_atomic(path, self.to_dict())
        return path

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class DatasetManifest(_ManifestBase):
    """What ``pack-shards`` wrote: classes (sorted; label = index), splits of shards, provenance."""

    storage: str
    classes: tuple[str, ...]
    splits: Mapping[str, SplitInfo]
    source: SourceInfo
    packing: Mapping[str, Any]
    created: str = field(default_factory=utc_now)
    tool: str = TOOL
    extra: Mapping[str, Any] = field(default_factory=dict)

    kind = "images"
    FORMAT = DATASET_FORMAT
    FILE = DATASET_FILE

    def _body(self) -> dict[str, Any]:
        return {"source": self.source.to_dict(), "packing": dict(self.packing)}

    @classmethod
    def _parse_body(cls, data: Mapping[str, Any], where: str) -> dict[str, Any]:
        return {"source": SourceInfo.from_dict(data["source"]), "packing": dict(data.get("packing", {}))}


@dataclass(frozen=True)
class FeatureManifest(_ManifestBase):
    """What ``precompute-features`` wrote: one feature shard per image shard, same order and keys.

    ``config`` holds everything that changes the numbers (backbone, weights sha256, transform, views, dtype);
    ``config_hash`` is its digest and ``dataset_sha256`` the digest of the ``dataset.json`` it was computed from.
    """

    storage: str  # "pt" or "hdf5"
    classes: tuple[str, ...]
    splits: Mapping[str, SplitInfo]
    features_dim: int
    dtype: str
    views: int
    config: Mapping[str, Any]
    config_hash: str
    dataset_dir: str
    dataset_sha256: str
    created: str = field(default_factory=utc_now)
    tool: str = TOOL
    extra: Mapping[str, Any] = field(default_factory=dict)

    kind = "features"
    FORMAT = FEATURES_FORMAT
    FILE = FEATURES_FILE

    def _body(self) -> dict[str, Any]:
        return {"features_dim": self.features_dim, "dtype": self.dtype, "views": self.views,
                "config": dict(self.config), "config_hash": self.config_hash, "dataset_dir": self.dataset_dir,
                "dataset_sha256": self.dataset_sha256}

    @classmethod
    def _parse_body(cls, data: Mapping[str, Any], where: str) -> dict[str, Any]:
        return {"features_dim": int(data["features_dim"]), "dtype": str(data["dtype"]),
                "views": int(data.get("views", 0)), "config": dict(data["config"]),
                "config_hash": str(data["config_hash"]),
                "dataset_dir": check_dataset_dir(data["dataset_dir"], where=where),
                "dataset_sha256": str(data["dataset_sha256"])}


Manifest = DatasetManifest | FeatureManifest


def load_dataset_manifest(folder: str | os.PathLike, *, url_origins: Iterable[str] = ()) -> DatasetManifest:
    path = Path(folder) / DATASET_FILE
    return DatasetManifest.from_dict(read_json_file(path), where=str(path), url_origins=url_origins)


def load_feature_manifest(folder: str | os.PathLike) -> FeatureManifest:
    path = Path(folder) / FEATURES_FILE
    return FeatureManifest.from_dict(read_json_file(path), where=str(path))


def load_manifest(folder: str | os.PathLike, *, url_origins: Iterable[str] = ()) -> Manifest:
    """Read whichever manifest ``folder`` holds (a folder, or the path of a manifest file itself).

    ``url_origins``: the caller's opt-in to ``http(s)`` shard URLs on those origins in a ``dataset.json``."""
    folder = Path(folder)
    if folder.is_file():
        folder = folder.parent
    if not folder.exists():
        raise MissingInputError("no such folder", path=str(folder))
    if (folder / FEATURES_FILE).exists():
        return load_feature_manifest(folder)
    if (folder / DATASET_FILE).exists():
        return load_dataset_manifest(folder, url_origins=url_origins)
    raise ManifestError(
        f"holds neither {DATASET_FILE} nor {FEATURES_FILE} (unfinished or not a shardcache folder)",
        path=str(folder),
    )
