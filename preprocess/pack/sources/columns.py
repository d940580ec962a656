"""The scanned source files as columns: what lets ``pack-shards`` plan 1.28M files in tens of MB, not gigabytes.

A Python object per file (a tuple, three strings, two big ints) cost ~710 bytes a file at the peak of scan and
plan; here a file costs its relative path's UTF-8 bytes plus 30 bytes of numpy columns (path offset, label, split
code, size, mtime), ~50 bytes measured. The key and the absolute path are not stored: both are functions of the
relative path (``sample_key`` and ``os.path.join(base, rel_path)``), computed when a row is read.

Samples that are members of container files (``preprocess.pack.sources.members``: Parquet rows, tar samples) add an
``offset`` column (where in its file), and those read a block at a time (Parquet row groups) a ``block`` column:
16 bytes more each; an ImageFolder or list scan has neither.

``SourceSamples`` is a read-only sequence of ``SourceSample`` over shared columns, optionally through an array of
row numbers, so a split, a shuffled order or one shard is a view that costs 8 bytes a row and copies no path.
Pickled (a shard job sent to a worker process), a view carries only its own rows.
"""

from __future__ import annotations

import hashlib
import os
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Iterable, Iterator, NamedTuple, overload

import numpy as np

from preprocess.pack.sources.members import member_key
from shards.errors import InputError

_BATCH = 4096  # rows converted to Python values at a time when iterating
NO_SPLIT = -1  # split code of a file whose source has no split (the packer assigns one)
KEY_SLUG_CHARS = 64
KEY_HASH_CHARS = 12
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class SourceSample(NamedTuple):
    """One source file to pack. ``rel_path`` (POSIX, relative to the source root) is its identity."""

    key: str
    rel_path: str
    abs_path: str
    label: int
    split: str | None  # None: the source has no split; the packer assigns one
    size: int
    mtime_ns: int
    # Where in its container file the bytes are (``preprocess.pack.sources.members``): a Parquet/Arrow row number or the
    # byte offset of a tar sample's first header; -1 for a sample that is a whole file.
    offset: int = -1


def sample_key(rel_path: str) -> str:
    """A tar-safe key: an ASCII slug of the path (no dots, since webdataset splits the key at the first dot)
    plus a hash of the full path, so two classes holding ``img.jpg`` never collide."""
    slug = _UNSAFE.sub("_", rel_path).strip("_")[-KEY_SLUG_CHARS:].lstrip("_") or "sample"
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:KEY_HASH_CHARS]
    return f"{slug}-{digest}"


@dataclass(frozen=True, eq=False)
class _Columns:
    base: str  # absolute paths are os.path.join(base, rel_path)
    paths: bytes | bytearray  # every relative path's UTF-8 bytes, back to back
    offsets: np.ndarray  # int64, len N + 1: path i is paths[offsets[i]:offsets[i + 1]]
    label: np.ndarray  # int32
    split: np.ndarray  # int16 index into split_names, or NO_SPLIT
    split_names: tuple[str, ...]
    size: np.ndarray  # int64
    mtime_ns: np.ndarray  # int64
    offset: np.ndarray | None = None  # int64, members of container files only (None: every sample a whole file)
    kept_keys: bool = False  # keys are the member's own (a WebDataset key), not derived by ``sample_key``
    # int64, sources read a block at a time (a Parquet row group): samples of one block share its number, so the
    # plan can keep them together (``preprocess.pack.plan.block_shuffle``); None: each sample is read alone.
    block: np.ndarray | None = None


class SourceSamples(Sequence):
    """Read-only ``Sequence[SourceSample]`` over columns; ``rows`` (or every row, in order) selects and orders."""

    __slots__ = ("_cols", "_rows")

    def __init__(self, cols: _Columns, rows: np.ndarray | None = None):
        self._cols = cols
        self._rows = rows

    def __len__(self) -> int:
        return len(self._cols.size) if self._rows is None else len(self._rows)

    @overload
    def __getitem__(self, i: int) -> SourceSample: ...
    @overload
    def __getitem__(self, i: slice) -> SourceSamples: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            if self._rows is not None:
                return SourceSamples(self._cols, self._rows[i])
            return SourceSamples(self._cols, np.arange(*i.indices(len(self)), dtype=np.int64))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} of {n}")
        return next(iter(self.take(np.array([i % n]))))

    def __iter__(self) -> Iterator[SourceSample]:
        """Rows are read a batch at a time, as Python values from whole columns (numpy scalars are slow)."""
        c, rows = self._cols, self.rows()
        prefix = c.base if c.base.endswith("/") else c.base + "/"
        names = c.split_names + (None,)  # NO_SPLIT (-1) picks None
        key_of = member_key if c.kept_keys else sample_key
        for first in range(0, len(rows), _BATCH):
            batch = rows[first:first + _BATCH]
            columns = (c.offsets[batch], c.offsets[batch + 1], c.label[batch], c.split[batch], c.size[batch],
                       c.mtime_ns[batch])
            places = repeat(-1) if c.offset is None else c.offset[batch].tolist()
            for start, stop, label, split, size, mtime_ns, offset in zip(*(col.tolist() for col in columns), places):
                rel_path = c.paths[start:stop].decode("utf-8")
                abs_path = rel_path if rel_path.startswith("/") else prefix + rel_path
                yield SourceSample(key_of(rel_path), rel_path, abs_path, label, names[split], size, mtime_ns,
                                   offset)

    def __reduce__(self):
        """Pickle only the rows this view selects (a shard job carries its own shard, not the whole scan)."""
        return SourceSamples, (self._compact(),)

    def rows(self) -> np.ndarray:
        """Row numbers into the shared columns, in this view's order."""
        return np.arange(len(self._cols.size)) if self._rows is None else self._rows

    def take(self, positions: np.ndarray) -> SourceSamples:
        """The samples at ``positions`` of this view (an int array), as a view of the same columns."""
        positions = np.asarray(positions, dtype=np.int64)
        return SourceSamples(self._cols, positions if self._rows is None else self._rows[positions])

    def rel_paths(self) -> Iterator[str]:
        c, rows = self._cols, self.rows()
        for first in range(0, len(rows), _BATCH):
            batch = rows[first:first + _BATCH]
            for start, stop in zip(c.offsets[batch].tolist(), c.offsets[batch + 1].tolist()):
                yield c.paths[start:stop].decode("utf-8")

    @property
    def base(self) -> str:
        return self._cols.base

    @property
    def split_names(self) -> tuple[str, ...]:
        return self._cols.split_names

    @property
    def has_blocks(self) -> bool:
        return self._cols.block is not None

    def column(self, name: str) -> np.ndarray:
        """``label``, ``split`` (codes into ``split_names``), ``size``, ``mtime_ns``, ``offset`` or ``block`` of this
        view's rows (the last two only where the source has them)."""
        values = getattr(self._cols, name)
        return values if self._rows is None else values[self._rows]

    @property
    def kept_keys(self) -> bool:
        return self._cols.kept_keys

    def nbytes(self) -> int:
        c = self._cols
        arrays = (c.offsets, c.label, c.split, c.size, c.mtime_ns) + tuple(a for a in (c.offset, c.block)
                                                                            if a is not None)
        own = len(c.paths) + sum(a.nbytes for a in arrays)
        return own + (0 if self._rows is None else self._rows.nbytes)

    def _compact(self) -> _Columns:
        c, rows = self._cols, self._rows
        if rows is None:
            return c
        starts, stops = c.offsets[rows], c.offsets[rows + 1]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(stops - starts, out=offsets[1:])
        paths = b"".join([c.paths[a:b] for a, b in zip(starts.tolist(), stops.tolist())])
        return _Columns(c.base, paths, offsets, c.label[rows], c.split[rows], c.split_names, c.size[rows],
                        c.mtime_ns[rows], None if c.offset is None else c.offset[rows], c.kept_keys,
                        None if c.block is None else c.block[rows])


def printable_name(name: str) -> str:
    """``name`` as a message can print it: bytes that are not UTF-8 (which Python's file names carry as surrogate
    escapes) as ``\\xNN``."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def is_utf8_name(name: str) -> bool:
    """Whether ``name`` is valid UTF-8 (no surrogate escapes), as a manifest must hold it."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class SamplesBuilder:
    """Collects scanned files row by row into growable typed arrays (no per-file Python object is kept)."""

    def __init__(self, base: str, split_names: Iterable[str] = (), *, members: bool = False, kept_keys: bool = False,
                 blocks: bool = False):
        self.base = base
        self.kept_keys = kept_keys
        self.split_names = tuple(split_names)
        self._code = {name: i for i, name in enumerate(self.split_names)}
        self._paths = bytearray()
        self._offsets = array("q", [0])
        self._label = array("i")
        self._split = array("h")
        self._size = array("q")
        self._mtime = array("q")
        self._offset = array("q") if members else None
        self._block = array("q") if blocks else None

    def add(self, rel_path: str, label: int, split: str | None, size: int, mtime_ns: int, offset: int = -1,
            block: int = -1) -> None:
        try:
            self._paths += rel_path.encode("utf-8")
        except UnicodeEncodeError:  # a name the file system gave as bytes (surrogate escapes): no manifest holds it
            raise InputError("name is not valid UTF-8 (rename it)",
                             path=printable_name(os.path.join(self.base, rel_path))) from None
        self._offsets.append(len(self._paths))
        self._label.append(label)
        self._split.append(NO_SPLIT if split is None else self._split_code(split))
        self._size.append(size)
        self._mtime.append(mtime_ns)
        if self._offset is not None:
            self._offset.append(offset)
        if self._block is not None:
            self._block.append(block)

    def _split_code(self, split: str) -> int:
        if split not in self._code:
            self._code[split] = len(self.split_names)
            self.split_names += (split,)
        return self._code[split]

    def renumber_labels(self, new_label: Sequence[int]) -> None:
        """Label ``i`` becomes ``new_label[i]`` (a list file's labels, numbered as first seen, sorted at the end)."""
        mapping = np.asarray(new_label, dtype=np.int32)
        labels = np.frombuffer(self._label, dtype=np.int32) if len(self._label) else np.zeros(0, dtype=np.int32)
        self._label = array("i", mapping[labels].tobytes()) if len(labels) else array("i")

    def build(self) -> SourceSamples:
        """The columns, sharing the builder's buffers (no copy: at 1.28M files a copy was half the peak)."""
        def np_of(values: array, dtype) -> np.ndarray:
            return np.frombuffer(values, dtype=dtype) if len(values) else np.zeros(0, dtype=dtype)
        cols = _Columns(self.base, self._paths, np_of(self._offsets, np.int64), np_of(self._label, np.int32),
                        np_of(self._split, np.int16), self.split_names, np_of(self._size, np.int64),
                        np_of(self._mtime, np.int64), None if self._offset is None else np_of(self._offset, np.int64),
                        self.kept_keys, None if self._block is None else np_of(self._block, np.int64))
        return SourceSamples(cols)


def as_samples(samples: Iterable[SourceSample], default_base: str, *, kept_keys: bool = False) -> SourceSamples:
    """Columns from ``SourceSample`` rows (``--append`` relabels a scan's files); a view is returned as is. The
    base is the one the rows were scanned under (their absolute path less their relative one: the source may
    have moved since ``default_base`` was recorded), the same for every row, as a scan makes them."""
    if isinstance(samples, SourceSamples):
        return samples
    rows = list(samples)
    relative = next((s for s in rows if not s.rel_path.startswith("/")), None)
    base = default_base if relative is None else relative.abs_path[:-len(relative.rel_path)].rstrip("/") or "/"
    builder = SamplesBuilder(base, members=any(s.offset >= 0 for s in rows), kept_keys=kept_keys)
    for s in rows:
        if os.path.join(base, s.rel_path) != s.abs_path:
            raise ValueError(f"{s.abs_path}: not {s.rel_path!r} under {base}, the base of the other samples")
        builder.add(s.rel_path, s.label, s.split, s.size, s.mtime_ns, s.offset)
    return builder.build()
