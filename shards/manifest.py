"""The manifests: the versioned contract between the stages and the commit marker of each output folder.

``dataset.json`` describes image shards (written by ``pack-shards``); ``features.json`` describes feature shards
(written by ``precompute-features``). Both are written last and atomically; a folder without one is unfinished.
Readers check ``format`` and ``version`` and refuse what they do not know. Unknown extra keys are kept in
``extra`` so a newer minor writer does not break an older reader.

A manifest is untrusted (docs/trust-model.md, "One door"): every field is read through ``shards.door.shape``, never
converted, so ``"7"``, ``2.5``, ``true``, ``NaN`` or ``1e30`` where a count belongs, or a list where an object
belongs, is one ``ManifestError`` naming the file and the field's path
(``dataset.json: splits.train.shards[3].samples is 2.5: expected an integer``). Per-shard class counts can be
millions of integers in all, so lists of counts are checked in C (``as_int_list``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, Mapping

from shards.atomic import write_json_atomic
from shards.door.bounded_read import read_json_file
from shards.errors import ManifestError, MissingInputError
from shards.formats.feature_names import check_target
from shards.door.locations import check_dataset_dir, check_shard_path
from shards.door.shape import as_int, as_int_list, as_list, as_object, as_str, field as get
from shards.provenance import SourceInfo

TOOL = "shardcache 0.1.0"
DATASET_FORMAT = "shardcache.dataset"
FEATURES_FORMAT = "shardcache.features"
DATASET_FILE = "dataset.json"
FEATURES_FILE = "features.json"
VERSION = 1
# Bounds on what a feature manifest may declare: every reader allocates rows x features_dim (x views) from them, so
# a tampered value must not ask for an allocation or a loop no real backbone or table needs.
MAX_FEATURES_DIM = 1 << 24
MAX_VIEWS = 1 << 12


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
    def from_dict(cls, data: Any, where: str | None = None, url_origins: Iterable[str] = (),
                  what: str = "shard") -> "ShardInfo":
        """The shard entry ``data`` (named ``what`` in errors: ``splits.train.shards[3]``), every field checked for
        its type and range; ``path`` (and ``source``, ``index``) must be shard names confined to the manifest's
        folder (``shards.door.locations.check_shard_path``; ``url_origins``: where shard URLs may point)."""
        data = as_object(data, what, where=where)
        samples = as_int(get(data, "samples", what, where=where), f"{what}.samples", where=where)
        source, index = _optional_str(data, "source", what, where), _optional_str(data, "index", what, where)
        return cls(
            path=check_shard_path(as_str(get(data, "path", what, where=where), f"{what}.path", where=where),
                                  where=where, url_origins=url_origins),
            samples=samples,
            bytes=as_int(get(data, "bytes", what, where=where), f"{what}.bytes", where=where),
            sha256=as_str(get(data, "sha256", what, where=where), f"{what}.sha256", max_len=128, where=where),
            source=None if source is None else check_shard_path(source, where=where),
            source_sha256=_optional_str(data, "source_sha256", what, where, max_len=128),
            index=None if index is None else check_shard_path(index, where=where),
            index_sha256=_optional_str(data, "index_sha256", what, where, max_len=128),
            class_counts=cls._parse_class_counts(data.get("class_counts"), samples, f"{what}.class_counts", where),
        )

    @staticmethod
    def _parse_class_counts(value: Any, samples: int, what: str, where: str | None) -> tuple[int, ...] | None:
        """Absent (None), or a list of counts summing to the shard's ``samples``. ``as_int_list`` checks in C: at
        1,000 classes x 1,280 shards a generator over every count was most of the time ``open_dataset`` spent
        before its first batch."""
        if value is None:
            return None
        counts = as_int_list(value, what, hi=None, where=where)  # bounded by their sum, checked next
        if sum(counts) != samples:
            raise ManifestError(f"{what} sum to {sum(counts):,}, but the shard has {samples:,} samples", path=where)
        return tuple(counts)


def _optional_str(data: Mapping[str, Any], name: str, what: str, where: str | None,
                  max_len: int = 4096) -> str | None:
    """``data[name]`` when it is a string, None when absent or null; anything else is an error naming it."""
    value = data.get(name)
    return None if value is None else as_str(value, f"{what}.{name}", max_len=max_len, where=where)


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
    def from_dict(cls, data: Any, where: str | None = None, url_origins: Iterable[str] = (),
                  what: str = "split") -> "SplitInfo":
        """The split entry ``data`` (named ``what`` in errors: ``splits.train``), each shard checked in turn."""
        data = as_object(data, what, where=where)
        entries = as_list(get(data, "shards", what, where=where), f"{what}.shards", where=where)
        shards = tuple(ShardInfo.from_dict(s, where, url_origins, f"{what}.shards[{i}]") for i, s in enumerate(entries))
        paths = [shard.path for shard in shards]
        if len(set(paths)) != len(paths):  # every reader would read it again: a 20 KB manifest, 20,000 reads
            seen: set[str] = set()
            twice = next(path for path in paths if path in seen or seen.add(path))
            raise ManifestError(f"{what}.shards lists {twice!r} more than once", path=where)
        return cls(
            samples=as_int(get(data, "samples", what, where=where), f"{what}.samples", where=where),
            class_counts=tuple(as_int_list(get(data, "class_counts", what, where=where), f"{what}.class_counts",
                                           where=where)),
            shards=shards,
        )

    @property
    def shard_sizes(self) -> list[int]:
        return [s.samples for s in self.shards]


def _check_header(data: Any, expected_format: str, where: str) -> None:
    if type(data) is not dict:
        raise ManifestError("not a JSON object", path=where)
    fmt = data.get("format")
    if type(fmt) is not str or fmt != expected_format:
        raise ManifestError(f"format is {fmt!r}, expected {expected_format!r}", path=where)
    version = data.get("version")
    if type(version) is not int or version != VERSION:  # True == 1 == 1.0 in Python; only the integer 1 is 1
        raise ManifestError(
            f"manifest version {version!r} is not supported by {TOOL} (knows version {VERSION}); "
            "upgrade shardcache or repack",
            path=where,
        )


def _classes(value: Any, where: str) -> tuple[str, ...]:
    """The class names: a list of distinct strings (a label is an index into it, so a name listed twice would merge
    two labels silently). Checked with set and max over the list, in C, as a class list may be long."""
    names = as_list(value, "classes", where=where)
    if names and (not set(map(type, names)) <= {str} or max(map(len, names)) > 4096):
        index, bad = next((i, n) for i, n in enumerate(names) if type(n) is not str or len(n) > 4096)
        as_str(bad, f"classes[{index}]", where=where)
    if len(set(names)) != len(names):
        seen: set[str] = set()
        twice = next(n for n in names if n in seen or seen.add(n))
        raise ManifestError(f"classes name {twice!r} twice: each class is one label", path=where)
    return tuple(names)


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
        body = cls._parse_body(data, where)
        known = _COMMON_KEYS | set(body)
        splits = as_object(get(data, "splits", "", where=where), "splits", where=where)
        return cls(
            storage=as_str(get(data, "storage", "", where=where), "storage", max_len=64, where=where),
            classes=_classes(get(data, "classes", "", where=where), where),
            splits={name: SplitInfo.from_dict(s, where, origins, f"splits.{name}") for name, s in splits.items()},
            created=as_str(get(data, "created", "", default="", where=where), "created", where=where),
            tool=as_str(get(data, "tool", "", default="", where=where), "tool", where=where),
            extra={k: v for k, v in data.items() if k not in known},
            **body,
        )

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
        _check_source_index(data.get("source_index"), where)
        return {"source": SourceInfo.from_dict(get(data, "source", "", where=where), where),
                "packing": as_object(get(data, "packing", "", default={}, where=where), "packing", where=where)}


def _check_source_index(entry: Any, where: str) -> None:
    """The ``source_index`` entry pack-shards writes (``{"path", "entries", "sha256"}``), kept in ``extra`` for
    the readers of the index (``shards.select.rows``, ``shards verify``, ``--append``): its name held to the
    shards' rule, its count and digest of their types. Absent in datasets packed before it existed."""
    if entry is None:
        return
    entry = as_object(entry, "source_index", where=where)
    check_shard_path(as_str(get(entry, "path", "source_index", where=where), "source_index.path", where=where),
                     where=where, what="source index")
    as_int(get(entry, "entries", "source_index", default=0, where=where), "source_index.entries", where=where)
    if entry.get("sha256") is not None:
        as_str(entry["sha256"], "source_index.sha256", max_len=128, where=where)


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
        config = as_object(get(data, "config", "", where=where), "config", where=where)
        check_target(config, where)
        return {"features_dim": as_int(get(data, "features_dim", "", where=where), "features_dim", lo=1,
                                       hi=MAX_FEATURES_DIM, where=where),
                "dtype": as_str(get(data, "dtype", "", where=where), "dtype", max_len=64, where=where),
                "views": as_int(get(data, "views", "", default=0, where=where), "views", hi=MAX_VIEWS, where=where),
                "config": config,
                "config_hash": as_str(get(data, "config_hash", "", where=where), "config_hash", max_len=128,
                                      where=where),
                "dataset_dir": check_dataset_dir(get(data, "dataset_dir", "", where=where), where=where),
                "dataset_sha256": as_str(get(data, "dataset_sha256", "", where=where), "dataset_sha256", max_len=128,
                                         where=where)}


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
