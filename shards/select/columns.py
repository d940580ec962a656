"""A split's column index opened from any location: local files mapped in place, remote ones copied first (into
the node cache when there is one), every file held to ``shards.formats.columns``' checks before it is mapped.

The format (names, header, checks, mapping a local file) is ``shards.formats.columns``'; this module adds where the
files are, which is the location layer's and the cache's business, so the format stays below both.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from shards.atomic import unique_tmp_path
from shards.errors import CorruptDataError, ManifestError, ShardcacheError
from shards.formats.columns import COLUMNS_KEY, FORMAT, HASH_BLOCK, allowed_dtype, map_column
from shards.cache.cached_shards import CachedShards
from shards.cache.node import NodeCache, ShardCache
from shards.transport.location import Location, locate


class _Fetched:
    """Local copies of a remote dataset's column files: in the node cache when one is given, else in a private
    temp folder removed at exit."""

    def __init__(self, cache: Any):
        if isinstance(cache, CachedShards):
            cache = cache.request
        if isinstance(cache, (str, os.PathLike)):
            cache = ShardCache(dir=cache)
        if isinstance(cache, ShardCache):
            cache = NodeCache(cache) if cache.dir is not None else None
        self.node: NodeCache | None = cache
        self.leases: list[Any] = []  # held while the columns are: the cache does not evict a mapped copy
        self.folder: Path | None = None

    def copy(self, where: Location, size: int, sha256: str) -> Path:
        if self.node is not None:
            def fetch(out: Any) -> None:
                with where.open() as stream:
                    shutil.copyfileobj(stream, out, HASH_BLOCK)
            try:
                lease = self.node.acquire(sha256, size, ".npy", fetch, str(where))
            except CorruptDataError as exc:
                raise CorruptDataError(exc.reason, path=str(where)) from None
            if lease is not None:
                self.leases.append(lease)
                return lease.path
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="shardcache-columns-"))
            atexit.register(shutil.rmtree, self.folder, True)
        path = self.folder / f"{sha256}.npy"
        if not path.exists():
            tmp = unique_tmp_path(path)
            with where.open() as stream, open(tmp, "wb") as out:
                copied = 0
                while copied <= size and (data := stream.read(HASH_BLOCK)):  # never more than size + a block
                    out.write(data)
                    copied += len(data)
            os.replace(tmp, path)
        return path


class SplitColumns:
    """One split's columns, opened lazily: each file is checked and mapped on first use."""

    def __init__(self, base: Location, split: str, entry: Mapping[str, Any], *, where: str, cache: Any = None):
        self.base = base
        self.split = split
        self.where = where
        rows = entry.get("rows")
        fields = entry.get("fields")
        unindexed = entry.get("unindexed", [])
        if (type(rows) is not int or rows < 0 or not isinstance(fields, Mapping)
                or not isinstance(unindexed, list) or not all(isinstance(n, str) for n in unindexed)):
            raise ManifestError(f"malformed columns entry for split {split!r}", path=where)
        self.rows: int = rows
        # key and label first, then the metadata fields (dataset.json stores its keys sorted)
        self.fields: tuple[str, ...] = tuple(sorted(fields, key=lambda name: (name not in ("key", "label"),
                                                                              name != "key")))
        self.unindexed: tuple[str, ...] = tuple(unindexed)
        self._specs = dict(fields)
        for name, spec in self._specs.items():
            self._check_spec(name, spec)
        self._cache = cache
        self._fetched: _Fetched | None = None
        self._arrays: dict[str, np.ndarray] = {}
        self._masks: dict[str, np.ndarray] = {}

    def _check_spec(self, name: str, spec: Any) -> None:
        def ok(item: Any) -> bool:
            return (isinstance(item, Mapping) and isinstance(item.get("path"), str)
                    and type(item.get("bytes")) is int and isinstance(item.get("sha256"), str))
        present = spec.get("present") if isinstance(spec, Mapping) else None
        if not ok(spec) or allowed_dtype(spec.get("dtype")) is None or not (present is None or ok(present)):
            raise ManifestError(f"malformed or unsupported column {name!r:.80} of split {self.split!r} "
                                f"(dtype {spec.get('dtype') if isinstance(spec, Mapping) else None!r:.40})",
                                path=self.where)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_arrays={}, _masks={}, _fetched=None)  # mapped again (and checked once) in each process
        return state

    def _open(self, spec: Mapping[str, Any], dtype: np.dtype) -> np.ndarray:
        where = self.base.child(spec["path"], where=self.where, what="column file")
        path = where.local_path()
        if path is not None:
            return map_column(path, spec, self.rows, dtype, str(where))
        if self._fetched is None:
            self._fetched = _Fetched(self._cache)
        path = self._fetched.copy(where, spec["bytes"], spec["sha256"])
        return map_column(path, spec, self.rows, dtype, str(where))

    def column(self, name: str) -> np.ndarray:
        """The read-only values of field ``name`` (``KeyError`` if it has no column); rows without the field hold
        0 / False / b"" (see ``present``)."""
        if name not in self._arrays:
            spec = self._specs[name]
            self._arrays[name] = self._open(spec, allowed_dtype(spec["dtype"]))
        return self._arrays[name]

    def present(self, name: str) -> np.ndarray | None:
        """Which rows have field ``name`` (a bool array), or None when every row has it."""
        spec = self._specs[name].get("present")
        if spec is None:
            return None
        if name not in self._masks:
            self._masks[name] = self._open(spec, np.dtype(bool))
        return self._masks[name]

    def path_of(self, name: str) -> str:
        """The manifest's path of field ``name``'s column file (``KeyError`` if it has no column)."""
        return self._specs[name]["path"]

    def files(self) -> Iterator[tuple[Mapping[str, Any], np.dtype]]:
        """The manifest entry and dtype of every file of this split (each column, then its mask, if any)."""
        for spec in self._specs.values():
            yield spec, allowed_dtype(spec["dtype"])
            if spec.get("present") is not None:
                yield spec["present"], np.dtype(bool)


def open_columns(base: Location | str | os.PathLike, manifest: Any, split: str, *,
                 cache: Any = None) -> SplitColumns | None:
    """The columns of ``split`` of the dataset at ``base`` (its folder or prefix), or None when its manifest
    records none (a dataset packed before columns existed: read the source index as before)."""
    base = locate(base)
    where = str(base.file(getattr(manifest, "FILE", "dataset.json")))
    entry = manifest.extra.get(COLUMNS_KEY)
    if entry is None:
        return None
    if not isinstance(entry, Mapping) or entry.get("format") != FORMAT or not isinstance(entry.get("splits"), Mapping):
        found = entry.get("format") if isinstance(entry, Mapping) else entry
        raise ManifestError(f"unknown columns format {found!r:.40} (this version reads {FORMAT!r})", path=where)
    split_entry = entry["splits"].get(split)
    if split_entry is None:
        return None
    if not isinstance(split_entry, Mapping):
        raise ManifestError(f"malformed columns entry for split {split!r}", path=where)
    columns = SplitColumns(base, split, split_entry, where=where, cache=cache)
    samples = manifest.splits[split].samples if split in manifest.splits else None
    if columns.rows != samples:
        raise ManifestError(f"the columns of split {split!r} have {columns.rows} rows, the split "
                            f"{'is not in the manifest' if samples is None else f'has {samples} samples'}",
                            path=where)
    return columns


def verify_columns(base: Location | str | os.PathLike, manifest: Any) -> list[str]:
    """Every problem with the column files ``manifest`` names (``shards verify``): each is read once, a remote
    one copied, and held to the reader's checks (size, header, sha256, hashed again here); one line each."""
    base = locate(base)
    problems: list[str] = []
    entry = manifest.extra.get(COLUMNS_KEY)
    splits = entry.get("splits") if isinstance(entry, Mapping) else None
    if entry is not None and not isinstance(splits, Mapping):  # open_columns names what is wrong with it
        splits = {name: None for name in manifest.splits}
    for split in (splits or {}):
        try:
            columns = open_columns(base, manifest, split)
        except ShardcacheError as exc:
            problems.append(str(exc))
            continue
        if columns is None:
            continue
        for item, dtype in columns.files():
            try:
                where = base.child(item["path"], where=columns.where, what="column file")
                with where.local_copy(item["bytes"] + 1) as path:
                    map_column(path, item, columns.rows, dtype, item["path"], recheck=True)
            except ShardcacheError as exc:
                problems.append(f"{item['path']}: {exc.reason}" if isinstance(exc, CorruptDataError) else str(exc))
    return problems
