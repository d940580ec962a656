"""From mixture sources to one combined split: class maps, subsets, the kept shards and their selected rows.

Each source's manifest is checked against the first (same kind; images in the same storage; features computed with
the same config), its classes are mapped onto the combined list (``same``: identical lists, else a one-line error;
``union``: the sorted union of names), and its subset is resolved shard by shard: a shard whose per-shard class
counts hold none of the wanted classes is dropped unread, one that holds only wanted classes is kept whole, and
the rest are filtered row by row (``shards.select.rows``). Only shards with a selected row enter the combined
split, so a dropped shard is never opened, now or while streaming.

A source packed with a column index (``shards.formats.columns``) is resolved over its columns instead, vectorised
and without a Python object per sample: wanted classes through the label column, keys by a binary search of the
key column, ``where`` by ``Where.mask``, ``max_samples`` by counting, then the selected rows are cut at the shard
boundaries. It selects the same rows, counts the same classes, leaves the same shards unopened and raises the same
errors as the row-by-row path, which stays for datasets packed before, feature folders, and filters that read a
field the columns do not index. A Python callable ``where`` is the slow path: it is called once per row, on fields
built from the columns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from shards.errors import CorruptDataError, InputError, ManifestError
from shards.manifest import SplitInfo
from shards.select.key_set import KeySet
from shards.select.mixture import MixOptions, Mixture, SourceSpec, draws
from shards.order.plan import ShardSlice
from shards.select.rows import SampleColumns, column_fields, index_rows, shard_fields
from shards.select.where import Where
from shards.transport.storage import get_storage

log = logging.getLogger(__name__)


@dataclass
class LoadedSource:
    """One source as ``open_dataset`` loaded it: its manifest, shard locations for the split, the local folder
    holding its source index (None when remote), ``read_all(i)``: every sample of its shard ``i``, and
    ``columns()``: the split's column index (``shards.select.columns.SplitColumns``), or None without one."""

    spec: SourceSpec
    manifest: Any
    split: SplitInfo
    locations: list[str]
    folder: str | None
    read_all: Callable[[int], Iterator[Any]]
    columns: Callable[[], Any] = lambda: None


@dataclass
class Combined:
    """The mixture as one split: what the streaming datasets are built from."""

    manifest: Any  # the first source's, with the combined classes and this split
    split: SplitInfo
    locations: list[str]
    label_maps: list[np.ndarray | None]  # per kept shard: source label -> combined label (None: the same)
    mixture: Mixture


def combine(sources: Sequence[LoadedSource], split: str, options: MixOptions, *, seed: int,
            shuffle: bool) -> Combined:
    first = sources[0].manifest
    for source in sources[1:]:
        _check_compatible(first, source)
    classes = combined_classes([s.manifest.classes for s in sources], [s.spec.path for s in sources],
                               options.class_map)
    shards, locations, label_maps, runs, per_source_counts = [], [], [], [], []
    offset = 0
    for source in sources:
        mapping = np.asarray([classes.index(c) for c in source.manifest.classes], dtype=np.int64)
        identity = len(mapping) == len(classes) and bool(np.all(mapping == np.arange(len(classes))))
        selected, own_counts = _select(source, classes)
        source_runs = []
        for shard, rows in selected:
            shards.append(source.split.shards[shard])
            locations.append(source.locations[shard])
            label_maps.append(None if identity else mapping)
            source_runs.append(rows.astype(np.int64) + offset)
            offset += source.split.shards[shard].samples
        counts = np.zeros(len(classes), dtype=np.int64)
        np.add.at(counts, mapping, np.asarray(own_counts, dtype=np.int64))
        runs.append(source_runs)
        per_source_counts.append([int(n) for n in counts])
        log.info("source %s, split %r: %d of %d samples selected in %d of %d shards", source.spec.path, split,
                 sum(len(r) for r in source_runs), source.split.samples, len(source_runs), len(source.split.shards))
    specs = tuple(s.spec for s in sources)
    available = [int(sum(len(r) for r in source_runs)) for source_runs in runs]
    draw = draws(specs, available, options.epoch_size)
    totals = np.sum(per_source_counts, axis=0) if per_source_counts else np.zeros(len(classes))
    mixture = Mixture(specs, runs, draw, seed, shuffle, tuple(int(n) for n in totals), per_source_counts,
                      tuple(classes))
    combined = SplitInfo(sum(s.samples for s in shards), mixture.class_counts, tuple(shards))
    manifest = first.replace(classes=tuple(classes), splits={split: combined})
    return Combined(manifest, combined, locations, label_maps, mixture)


def _check_compatible(first: Any, source: LoadedSource) -> None:
    other, where = source.manifest, source.spec.path
    if other.kind != first.kind:
        raise InputError(f"holds {other.kind}, the first source holds {first.kind}: mix sources of one kind", path=where)
    # Packed and adopted tars (shards index) mix: each shard is read in its own format.
    if first.kind == "images" and get_storage(other.storage).suffix != get_storage(first.storage).suffix:
        raise InputError(f"stores {other.storage} shards, the first source {first.storage}: mix sources of one "
                         "storage (repack one with --storage)", path=where)
    if first.kind == "features" and other.config_hash != first.config_hash:
        raise InputError(f"features were computed with another config (hash {other.config_hash} vs "
                         f"{first.config_hash}): mix features of one backbone, weights and transform", path=where)


def combined_classes(class_lists: Sequence[Sequence[str]], names: Sequence[str], class_map: str) -> list[str]:
    """The mixture's classes: the first source's, which every other must equal (``same``), or the sorted union of
    every source's names (``union``); ``names`` name the sources in the error."""
    first = list(class_lists[0])
    if class_map == "union":
        return sorted({c for classes in class_lists for c in classes})
    for name, classes in zip(names[1:], class_lists[1:]):
        theirs = list(classes)
        if theirs != first:
            only_theirs = sorted(set(theirs) - set(first))
            only_first = sorted(set(first) - set(theirs))
            detail = (f"only here: {', '.join(only_theirs[:5]) or '-'}; only in {names[0]}: "
                      f"{', '.join(only_first[:5]) or '-'}") if only_theirs or only_first \
                else "the same names in another order"
            raise InputError(f"its classes differ from the first source's ({detail}); pass class_map='union' "
                             "(--class-map union) to map labels by class name", path=name)
    return first


def _select(source: LoadedSource, classes: Sequence[str]) -> tuple[list[tuple[int, np.ndarray]], list[int]]:
    """``(shard, selected local rows)`` for every shard with a selected row, and the selected samples per class of
    the source's own class list."""
    subset, own, split = source.spec.subset, list(source.manifest.classes), source.split
    if subset.empty:  # the whole source: no shard is read to select it
        return [(i, np.arange(info.samples)) for i, info in enumerate(split.shards) if info.samples], \
            list(split.class_counts)
    wanted = None
    if subset.classes is not None:
        unknown = [c for c in subset.classes if c not in classes]
        if unknown:
            raise InputError(f"no class {', '.join(map(repr, unknown))} in the sources (classes: "
                             f"{', '.join(classes[:10])}{'...' if len(classes) > 10 else ''})", path=source.spec.path)
        wanted = np.asarray([c in subset.classes for c in own], dtype=bool)
    keys, where, left = subset.key_set(), subset.where, subset.max_samples
    excluded = subset.excluded_key_set()
    columns = source.columns()
    if columns is not None and _columns_cover(columns, where):
        selected = _select_columns(source, SampleColumns(columns, own), wanted, keys, where, left, excluded)
        if selected is not None:
            return selected
    return _select_rows(source, wanted, keys, where, left, excluded)


def _shard_counts(info: Any, classes: int) -> Sequence[int] | None:
    """A shard's per-class counts from the manifest, when they are for this manifest's ``classes``."""
    counts = getattr(info, "class_counts", None)
    return None if counts is None or len(counts) != classes else counts  # else: trust it to skip nothing


def _holds_none_wanted(info: Any, wanted: np.ndarray | None, classes: int) -> bool:
    """Whether the manifest says a shard holds no wanted class (so it is never opened)."""
    counts = _shard_counts(info, classes)
    return wanted is not None and counts is not None and not any(counts[c] for c in _indices(wanted))


def _indices(wanted: np.ndarray) -> list[int]:
    """The wanted class indices (a few of a thousand classes: each shard's check looks at those only)."""
    return np.flatnonzero(wanted).tolist()


def _select_rows(source: LoadedSource, wanted: np.ndarray | None, keys: KeySet | None,
                 where: Callable | None, left: int | None, excluded: KeySet | None = None
                 ) -> tuple[list[tuple[int, np.ndarray]], list[int]]:
    """``_select`` shard by shard, filtering rows from the source index or the shards themselves."""
    own, split = list(source.manifest.classes), source.split
    indexed = None
    out, totals = [], np.zeros(len(own), dtype=np.int64)
    for shard, info in enumerate(split.shards):
        if left is not None and left <= 0:
            break
        counts = _shard_counts(info, len(own))
        if _holds_none_wanted(info, wanted, len(own)):
            continue  # no wanted class in this shard: never opened
        whole = keys is None and excluded is None and where is None and counts is not None \
            and (wanted is None or all(w or n == 0 for n, w in zip(counts, wanted)))
        if whole and (left is None or left >= info.samples):
            rows = np.arange(info.samples)
            totals += np.asarray(counts, dtype=np.int64)
        else:
            if indexed is None:
                indexed = index_rows(source.folder, source.manifest) or {}
            rows, labels = _filter_rows(source, shard, indexed, wanted, keys, where, excluded)
            if left is not None:
                rows = rows[:left]
            totals += np.bincount(labels[rows], minlength=len(own))[: len(own)]
        if len(rows) == 0:
            continue
        if left is not None:
            left -= len(rows)
        out.append((shard, rows))
    return out, [int(n) for n in totals]


def _columns_cover(columns: Any, where: Callable | None) -> bool:
    """Whether a filter sees every field it needs in the columns (a callable sees all of a sample's fields)."""
    if where is None or not columns.unindexed:
        return True
    return isinstance(where, Where) and not where.fields & set(columns.unindexed)


def _select_columns(source: LoadedSource, view: SampleColumns, wanted: np.ndarray | None,
                    keys: KeySet | None, where: Callable | None, left: int | None,
                    excluded: KeySet | None = None) -> tuple[list[tuple[int, np.ndarray]], list[int]] | None:
    """``_select`` over the column index: one pass of array operations over the split, no object per sample.
    None when the filter fails on a row and only the source index can name that row's fields in the error."""
    split, own = source.split, source.manifest.classes
    sizes = np.asarray([info.samples for info in split.shards], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes)))  # shard s holds rows starts[s]:starts[s + 1]
    if view.rows != starts[-1]:
        raise ManifestError(f"its column index holds {view.rows} rows, the split's shards {int(starts[-1])} "
                            "samples", path=source.spec.path)
    opened = np.asarray([not _holds_none_wanted(info, wanted, len(own)) for info in split.shards], dtype=bool)
    live = np.repeat(opened, sizes)
    labels = view.column("label")
    bad = np.flatnonzero(live & ((labels < 0) | (labels >= len(own))))
    if len(bad):
        row = int(bad[0])
        shard = int(np.searchsorted(starts, row, side="right")) - 1
        raise CorruptDataError(f"label {int(labels[row])} is outside the manifest's {len(own)} classes",
                               path=source.locations[shard], key=view.column("key")[row].decode("utf-8", "replace"))
    if wanted is not None:
        live &= wanted[labels]
    if keys is not None:
        live &= keys.member(view.column("key"))
    if excluded is not None:
        live &= ~excluded.member(view.column("key"))
    if where is not None:
        live = _where_mask(view, where, live, starts, left)
        if live is None:
            return None
    rows = np.flatnonzero(live)
    if left is not None:
        rows = rows[:left]
    totals = np.bincount(labels[rows], minlength=len(own))[: len(own)]
    cuts = np.searchsorted(rows, starts)
    out = [(shard, rows[cuts[shard]:cuts[shard + 1]] - starts[shard]) for shard in range(len(sizes))
           if cuts[shard + 1] > cuts[shard]]
    return out, [int(n) for n in totals]


def _where_mask(view: SampleColumns, where: Callable, live: np.ndarray, starts: np.ndarray,
                left: int | None) -> np.ndarray | None:
    """The rows of ``live`` that pass ``where``, failing where the row-by-row path fails: on the first failing
    row, unless ``max_samples`` were selected before its shard (the row path stops before reading it)."""
    if not isinstance(where, Where):  # a Python callable: the slow path, one call per row, shard by shard
        mask, taken = np.zeros(view.rows, dtype=bool), 0
        for shard in range(len(starts) - 1):
            if left is not None and taken >= left:
                break
            for row in np.flatnonzero(live[starts[shard]:starts[shard + 1]]) + starts[shard]:
                if where(column_fields(view, int(row))):
                    mask[row] = True
                    taken += 1
        return mask
    mask, failure = where.mask_until_error(view, live)
    if failure is None:
        return mask
    shard_start = int(starts[np.searchsorted(starts, failure.row, side="right") - 1])
    if left is not None and np.count_nonzero(mask[:shard_start]) >= left:
        mask[shard_start:] = False
        return mask
    if view.unindexed:
        return None  # the error lists the row's fields, some of which only the source index holds
    raise failure.error


def _filter_rows(source: LoadedSource, shard: int, indexed: dict, wanted: np.ndarray | None,
                 keys: KeySet | None, where: Callable | None,
                 excluded: KeySet | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The rows of one shard that pass the subset's filters, and every row's label."""
    info, where_at, own = source.split.shards[shard], source.locations[shard], source.manifest.classes
    fields = shard_fields(info, indexed, lambda: source.read_all(shard), own, where_at)
    if len(fields) != info.samples:
        raise CorruptDataError(f"holds {len(fields)} samples, the manifest says {info.samples}", path=where_at)
    labels = np.asarray([f["label"] for f in fields], dtype=np.int64)
    bad = np.flatnonzero((labels < 0) | (labels >= len(own)))
    if len(bad):
        raise CorruptDataError(f"label {int(labels[bad[0]])} is outside the manifest's {len(own)} classes",
                               path=where_at, key=fields[int(bad[0])]["key"])
    mask = np.ones(len(fields), dtype=bool) if wanted is None else wanted[labels]
    if keys is not None:
        mask &= keys.contains_each([f["key"] for f in fields])
    if excluded is not None:
        mask &= ~excluded.contains_each([f["key"] for f in fields])
    if where is not None:
        mask &= np.asarray([bool(m and where(f)) for f, m in zip(fields, mask)], dtype=bool)
    return np.flatnonzero(mask), labels


def excluded_rows(keys: KeySet, columns: Any, dataset: Any) -> np.ndarray:
    """The global rows of ``dataset``'s split whose key is in ``keys``, for ``ShardDataset.exclude_rows``: over
    the split's column index (``columns``, a binary search per chunk of the key column) or, without one, from the
    keys of every shard, read in order."""
    if columns is not None:
        return np.flatnonzero(keys.member(columns.column("key")))
    rows, first = [], 0
    for shard, info in enumerate(dataset.split_info.shards):
        rows.extend(first + i for i, sample in enumerate(dataset.read_slice(ShardSlice(shard, 0, info.samples)))
                    if sample.key in keys)
        first += info.samples
    return np.asarray(rows, dtype=np.int64)
