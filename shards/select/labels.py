"""Each row's label of a (possibly combined) split, for class weighting: read once, before any epoch is ordered.

Class weighting is a step of the order (``shards.order.weights``), so the labels must be known up front, not found
by reading the shards on the way: an image dataset's come from its column index (``shards.select.columns``, one
mapped int32 column, ``label``), a feature folder's from its shards (each holds its rows' labels), and a mixture's
from each source's, by the shards it kept, mapped onto the combined classes. A source without a column index
has none to give, and reading every shard of it to find them would be a full pass before the first batch: that is
one clear error naming the folder.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from shards.errors import CorruptDataError, InputError
from shards.order.plan import shard_offsets


def column_labels(locations: Sequence[str], label_maps: Sequence[Any] | None, sources: Sequence[Any],
                  num_classes: int) -> np.ndarray:
    """The label of every global row of the split whose shards are at ``locations`` (int32), on its classes
    (``label_maps``: each shard's map onto a mixture's classes, or None), from the column index of whichever of
    ``sources`` (``LoadedSource``: its path, shard locations, split and ``columns()``) holds each shard. A label
    outside the ``num_classes`` classes is a ``CorruptDataError`` naming the shard."""
    return _checked(_column_labels(locations, label_maps, sources), locations, num_classes)


def shard_labels(dataset: Any, num_classes: int) -> np.ndarray:
    """``column_labels`` of a feature dataset, from its shards: each holds its labels, already mapped onto a
    mixture's classes."""
    pieces = [np.asarray(shard.labels, dtype=np.int64) for shard in dataset.shards(range(len(dataset.locations)))]
    return _checked(pieces, dataset.locations, num_classes)


def _checked(pieces: list[np.ndarray], locations: Sequence[str], num_classes: int) -> np.ndarray:
    for shard, labels in enumerate(pieces):
        bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
        if len(bad):
            raise CorruptDataError(f"label {int(labels[bad[0]])} of row {int(bad[0])} is outside the {num_classes} "
                                   "classes class weighting draws by", path=locations[shard])
    if not pieces:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(pieces).astype(np.int32)


def _column_labels(locations: Sequence[str], label_maps: Sequence[Any] | None,
                   sources: Sequence[Any]) -> list[np.ndarray]:
    """Per shard, its rows' labels from the column index of the source it came from."""
    held: dict[str, tuple[int, int, int]] = {}  # shard location -> (source, first row, end row) in its split
    for number, source in enumerate(sources):
        starts = shard_offsets(source.split.shard_sizes)
        for shard, location in enumerate(source.locations):
            held.setdefault(location, (number, int(starts[shard]), int(starts[shard + 1])))
    opened: dict[int, np.ndarray] = {}
    maps = label_maps or [None] * len(locations)
    pieces = []
    for location, mapping in zip(locations, maps):
        number, first, end = held[location]
        if number not in opened:
            columns = sources[number].columns()
            if columns is None:
                raise InputError("class weighting draws by each sample's label from the split's column index, "
                                 "which this dataset lacks (packed before it existed): add it with pack-shards "
                                 "--append", path=sources[number].spec.path)
            opened[number] = columns.column("label")
        labels = np.asarray(opened[number][first:end], dtype=np.int64)
        pieces.append(labels if mapping is None else _mapped(labels, mapping, location))
    return pieces


def _mapped(labels: np.ndarray, mapping: Any, location: str) -> np.ndarray:
    """A mixture source's labels on the combined classes (``mapping``: source class -> combined class)."""
    table = np.asarray(mapping, dtype=np.int64)
    if len(labels) and (labels.min() < 0 or labels.max() >= len(table)):
        raise CorruptDataError(f"a label is outside the source's {len(table)} classes", path=location)
    return table[labels]
