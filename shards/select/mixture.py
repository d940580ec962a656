"""Mixing and subsetting datasets without repacking: the source specs and the epoch's draw, as pure functions.

A mixture is several sources (dataset or feature folders, each optionally a subset of itself) read as one split.
Each source has a fixed number of samples per epoch (``draw``): its ``weight``'s share of the epoch
(``MixOptions.epoch_size``, default the sources' selected samples together), ``repeat`` times its selected samples,
or ``choose`` samples exactly (MosaicML streaming's ``Stream`` proportion/repeat/choose). So the epoch's size is
known before it starts, every rank gets the same count, and ``len()`` is exact.

The draw works on shards, not samples (open_clip PR #425 found shard-level mixing trains better, and it keeps every
read a sequential run): a source drawn ``d`` times its ``n`` selected samples reads every selected run
``d // n`` times, then, for the rest, whole shard runs in an order drawn from ``(seed, epoch, source)``, the last
one cut short. The epoch is these runs in an order drawn from ``(seed, epoch)`` (without shuffling: source by
source, shard by shard), flattened into global row indices of the combined split. That ordered array is what the
epoch plan deals to ranks and workers (``plan.share_of``) and what elastic resume replays, so mixing adds no
state of its own to save: the mixture is a pure function of (sources, seed, epoch), and its fingerprint goes into
the loader's state so a resume with other sources or weights is refused.
"""

from __future__ import annotations

import functools
import hashlib
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from shards.errors import InputError
from shards.door.shape import MAX_COUNT
from shards.order.plan import STREAM_MIX_DRAW, STREAM_MIX_ORDER, rng_for
from shards.select.key_set import KeySet, read_keys

CLASS_MAPS = ("same", "union")


def _check_count(value: Any, what: str) -> None:
    """A count of samples (``choose``, ``max_samples``, ``epoch_size``): None, or an integer from 1 to
    ``MAX_COUNT``. ``int()`` would take ``"7"``, ``2.5`` and ``True`` silently, and the epoch's draw allocates by
    it, so nothing is converted."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                              or not 1 <= value <= MAX_COUNT):
        raise InputError(f"{what}={value!r} must be an integer from 1 to {MAX_COUNT:,}")


@dataclass(frozen=True)
class Subset:
    """Which samples of a source to read: ``classes`` (names), ``keys`` (a file of sample keys, one per line, or
    the keys themselves), ``where`` (a filter on the per-sample metadata: ``"width >= 256"`` or, from Python, a
    callable taking the sample's fields), less ``exclude_keys`` (a file of keys, one per line, or the keys), then at
    most ``max_samples`` of what is left, in manifest order (the same samples every epoch). Shards holding none of
    ``classes`` are never read (the manifest's per-shard class counts say so); the rest of the filtering reads the dataset's source index, or the shards themselves when
    there is none (``shards.select.rows``)."""

    classes: tuple[str, ...] | None = None
    keys: Any = None
    where: Any = None
    max_samples: int | None = None
    exclude_keys: Any = None

    def __post_init__(self) -> None:
        if self.classes is not None:
            if isinstance(self.classes, str):
                raise InputError(f"Subset.classes={self.classes!r} must be a list of class names, not one string")
            object.__setattr__(self, "classes", tuple(str(c) for c in self.classes))
            if not self.classes:
                raise InputError("Subset.classes is empty: name at least one class")
        _check_count(self.max_samples, "Subset.max_samples")
        for name in ("keys", "exclude_keys"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                object.__setattr__(self, name, frozenset(str(k) for k in value))  # an iterator is read once
        if self.where is not None and not callable(self.where):
            from shards.select.where import Where

            object.__setattr__(self, "where", Where(self.where))  # a bad filter fails here, before any read

    @property
    def empty(self) -> bool:
        return self.classes is None and self.keys is None and self.where is None and self.max_samples is None \
            and self.exclude_keys is None

    def key_set(self) -> KeySet | None:
        """The keys asked for, read once from their file (a path) or taken as given (an iterable of strings)."""
        return read_keys(self.keys)

    def excluded_key_set(self) -> KeySet | None:
        """The keys left out (``exclude_keys``), read as ``key_set`` reads its keys."""
        return read_keys(self.exclude_keys)

    def describe(self) -> dict[str, Any]:
        """What the run's config records (a callable filter is recorded by name)."""
        where = self.where
        where = getattr(where, "expression", None) or (None if where is None else getattr(where, "__name__", "callable"))
        keys, excluded = (None if value is None else str(value) if isinstance(value, (str, os.PathLike))
                          else f"{len(value)} keys" for value in (self.keys, self.exclude_keys))
        return {"classes": None if self.classes is None else list(self.classes), "keys": keys, "where": where,
                "max_samples": self.max_samples, "exclude_keys": excluded}


@dataclass(frozen=True)
class SourceSpec:
    """One source of a mixture: a dataset or feature folder (or ``s3://`` prefix) and how much of each epoch it
    fills: ``weight`` (a share; then every source needs one), ``repeat`` (times its samples; 1 by default) or
    ``choose`` (samples per epoch). ``subset`` reads only part of it (None: all of it); one folder's part is
    ``open_dataset(SourceSpec(path, subset=...))``. ``source``: where this source's shards are when not beside its
    manifest (the tars of an index made by ``shards index``), for this source only (``Remote.base_url`` is every
    source's), so adopted tars mix with packed datasets; the caller's choice, never a manifest's."""

    path: str
    weight: float | None = None
    repeat: float | None = None
    choose: int | None = None
    subset: Subset = field(default_factory=Subset)
    source: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", os.fspath(self.path))
        if self.source is not None:
            if not isinstance(self.source, (str, os.PathLike)):
                raise InputError(f"source {self.path}: source={self.source!r} must be a folder or URL")
            object.__setattr__(self, "source", os.fspath(self.source))
        if self.subset is None:  # None: the whole source, as Subset() says
            object.__setattr__(self, "subset", Subset())
        elif not isinstance(self.subset, Subset):
            raise InputError(f"source {self.path}: subset={self.subset!r} must be a Subset(classes=, keys=, where=, "
                             "max_samples=)")
        given = [name for name in ("weight", "repeat", "choose") if getattr(self, name) is not None]
        if len(given) > 1:
            raise InputError(f"source {self.path}: give one of weight, repeat or choose, not {' and '.join(given)}")
        for name in ("weight", "repeat"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                      or not (math.isfinite(value) and value > 0)):
                raise InputError(f"source {self.path}: {name}={value!r} must be a positive number")
        _check_count(self.choose, f"source {self.path}: choose")

    @classmethod
    def parse(cls, text: str, subset: Subset | None = None, option: str = "--data") -> SourceSpec:
        """``PATH``, ``PATH:WEIGHT``, ``PATH:repeat=R`` or ``PATH:choose=N`` (the form of ``option``'s values)."""
        path, _, tail = text.rpartition(":")
        subset = subset or Subset()
        if path and tail and not tail.startswith("//") and "/" not in tail:
            name, equals, value = tail.partition("=")
            try:
                if not equals:
                    return cls(path, weight=float(tail), subset=subset)
                if name == "repeat":
                    return cls(path, repeat=float(value), subset=subset)
                if name == "choose":
                    return cls(path, choose=int(value), subset=subset)
            except ValueError:
                raise InputError(f"{option} {text!r}: {tail!r} is not a weight, repeat=R or choose=N") from None
            raise InputError(f"{option} {text!r}: {tail!r} is not a weight, repeat=R or choose=N")
        return cls(text, subset=subset)

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "weight": self.weight, "repeat": self.repeat, "choose": self.choose,
                "subset": None if self.subset.empty else self.subset.describe()}


@dataclass(frozen=True)
class MixOptions:
    """How sources combine: ``class_map="same"`` (every source has the same classes) or ``"union"`` (the sorted
    union of their class names; each source's labels are mapped by name), and ``epoch_size`` (samples per epoch
    when the sources are weighted; default their selected samples together)."""

    class_map: str = "same"
    epoch_size: int | None = None

    def __post_init__(self) -> None:
        if self.class_map not in CLASS_MAPS:
            raise InputError(f"class_map={self.class_map!r} is not one of {', '.join(CLASS_MAPS)}")
        _check_count(self.epoch_size, "MixOptions.epoch_size")


def draws(specs: Sequence[SourceSpec], available: Sequence[int], epoch_size: int | None = None) -> list[int]:
    """Samples per epoch of each source: weights share ``epoch_size`` by largest remainder (exact totals), else
    ``choose`` or ``round(repeat * available)``."""
    weighted = [s.weight is not None for s in specs]
    if any(weighted) and not all(weighted):
        raise InputError("give every source a weight, or none (use repeat= or choose= for fixed amounts)")
    if epoch_size is not None and not all(weighted):
        raise InputError("epoch_size applies to weighted sources; give each source a weight")
    for spec, count in zip(specs, available):
        if count == 0:
            raise InputError("no sample of this source matches the subset", path=spec.path)
    if all(weighted):
        total = sum(available) if epoch_size is None else int(epoch_size)
        weights = np.asarray([float(s.weight) for s in specs])
        exact = total * weights / weights.sum()
        counts = np.floor(exact).astype(np.int64)
        for i in np.argsort(-(exact - counts), kind="stable")[: total - int(counts.sum())]:
            counts[i] += 1
        return [int(c) for c in counts]
    return [int(s.choose) if s.choose is not None else int(round((s.repeat or 1.0) * n))
            for s, n in zip(specs, available)]


@dataclass
class Mixture:
    """The selected runs of each source (global rows of the combined split, one array per kept shard) and the
    samples each source fills per epoch. ``stream(epoch)`` is the epoch's order; the rest describes it."""

    specs: tuple[SourceSpec, ...]
    runs: list[list[np.ndarray]]  # per source, per kept shard: its selected global rows, ascending
    draw: list[int]
    seed: int
    shuffle: bool
    class_counts: tuple[int, ...] = ()
    per_source_counts: list[list[int]] = field(default_factory=list)  # per source, selected samples per class
    classes: tuple[str, ...] = ()  # the combined class names the labels index (the union under class_map="union")
    _cache: dict = field(default_factory=dict, repr=False)  # the last epoch's rows

    @property
    def available(self) -> list[int]:
        return [int(sum(len(r) for r in runs)) for runs in self.runs]

    @property
    def epoch_size(self) -> int:
        return int(sum(self.draw))

    def stream(self, epoch: int) -> np.ndarray:
        """The epoch's global rows in order (kept for the last epoch asked: workers ask once per epoch)."""
        if self._cache.get("epoch") != epoch:
            self._cache.clear()
            self._cache.update(epoch=epoch, rows=epoch_rows(self.runs, self.draw, seed=self.seed, epoch=epoch,
                                                            shuffle=self.shuffle))
        return self._cache["rows"]

    @functools.cached_property
    def fingerprint(self) -> str:
        """What decides the epochs besides the seed: a saved state resumes only on the same mixture. Computed once
        (every checkpoint's loader state asks for it, and the runs never change)."""
        digest = hashlib.sha256()
        for runs, draw in zip(self.runs, self.draw):
            digest.update(np.int64(draw).tobytes())
            for rows in runs:
                digest.update(np.int64(len(rows)).tobytes())
                digest.update(np.ascontiguousarray(rows, dtype=np.int64).tobytes())
        return "mix-" + digest.hexdigest()[:16]

    def composition(self, classes: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Per source, what one epoch holds: samples selected and drawn, its share of the epoch, whole passes
        (and its selected samples per class, named by ``classes``, default the mixture's own)."""
        classes = self.classes if classes is None else classes
        total = max(1, self.epoch_size)
        out = []
        for i, (spec, available, draw) in enumerate(zip(self.specs, self.available, self.draw)):
            row = {**spec.describe(), "available": available, "drawn": draw, "share": draw / total,
                   "passes": draw / available if available else 0.0, "shards": len(self.runs[i])}
            if self.per_source_counts and classes:
                row["class_counts"] = {c: n for c, n in zip(classes, self.per_source_counts[i]) if n}
            out.append(row)
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = {}
        # A callable where= filter may not pickle (a lambda); workers never filter again, so keep its description.
        state["specs"] = tuple(SourceSpec(s.path, s.weight, s.repeat, s.choose, source=s.source) for s in self.specs)
        return state


def epoch_rows(runs: Sequence[Sequence[np.ndarray]], draw: Sequence[int], *, seed: int, epoch: int,
               shuffle: bool = True) -> np.ndarray:
    """The epoch's rows: each source's runs ``draw // available`` times plus a seeded choice of runs for the rest,
    all runs in an order drawn from ``(seed, epoch)``, flattened (see the module docstring)."""
    pieces: list[np.ndarray] = []
    for source, (source_runs, wanted) in enumerate(zip(runs, draw)):
        available = int(sum(len(r) for r in source_runs))
        passes, rest = divmod(int(wanted), available)
        pieces.extend(list(source_runs) * passes)
        if rest:
            order = (rng_for(seed, STREAM_MIX_DRAW, epoch, source).permutation(len(source_runs)) if shuffle
                     else range(len(source_runs)))
            for i in order:
                run = source_runs[int(i)]
                pieces.append(run[:rest])
                rest -= min(rest, len(run))
                if rest == 0:
                    break
    if shuffle and pieces:
        pieces = [pieces[int(i)] for i in rng_for(seed, STREAM_MIX_ORDER, epoch).permutation(len(pieces))]
    return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)


def as_specs(path: Any) -> tuple[SourceSpec, ...] | None:
    """The sources of an ``open_dataset`` call, or None for one plain folder (the unchanged path). A subset is
    a source's own (``SourceSpec(path, subset=...)``): it says which part of that source is read."""
    if isinstance(path, SourceSpec):
        specs: Iterable = [path]
    elif isinstance(path, (list, tuple)):
        specs = path
    else:
        return None
    out = [item if isinstance(item, SourceSpec) else SourceSpec(os.fspath(item)) for item in specs]
    if not out:
        raise InputError("open_dataset() got an empty list of sources")
    return tuple(out)


def unweighted(specs: Sequence[SourceSpec]) -> tuple[SourceSpec, ...]:
    """The same sources, each read once (validation reads every selected sample once, whatever the weights)."""
    return tuple(SourceSpec(s.path, subset=s.subset, source=s.source) for s in specs)


