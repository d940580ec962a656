"""Stream stages between reading and decoding: plain generators over items, seeded, content-blind where it matters.

Items are ``(where, sample, row)`` tuples: ``where`` names the shard for error messages, ``sample`` has ``key``
and ``label``, ``row`` is the sample's global index in its split (the key of a decoded-image cache). The shuffle
buffer is not a stage here: its order depends only on the item count and its generator, never on the bytes, so it is
index arithmetic in ``shards.order.order`` (``buffer_positions``), which a resumed run replays without decoding.
"""

from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


class Broken(NamedTuple):
    """Placeholder for a sample that could not be read, kept in the stream so counts and order stay fixed."""

    key: str | None
    label: int
    reason: str


def class_weights_from_counts(class_counts: Sequence[int]) -> list[float]:
    """Inverse frequency: every class present gets the same expected share; absent classes get weight 0."""
    return [0.0 if count == 0 else 1.0 / count for count in class_counts]


def systematic_resample(labels: Sequence[int], weights: Sequence[float], rng: np.random.Generator) -> np.ndarray:
    """Indices of ``len(labels)`` draws, each item picked in proportion to its class weight (low variance:
    an item's count is the floor or ceiling of its expected count). Items with an unknown label (-1) keep
    the mean weight so a broken sample is still counted, not silently dropped."""
    n = len(labels)
    table = np.asarray(list(weights) + [0.0], dtype=np.float64)
    mean = table[:-1][table[:-1] > 0].mean() if (table[:-1] > 0).any() else 1.0
    table[-1] = mean
    item_weights = table[np.asarray(labels, dtype=np.int64)]  # label -1 reads the last entry
    total = item_weights.sum()
    if n == 0 or total <= 0:
        return np.arange(n)
    edges = np.cumsum(item_weights) * (n / total)
    points = rng.random() + np.arange(n)
    picked = np.searchsorted(edges, points, side="right")
    picked = np.minimum(picked, n - 1)
    return picked[rng.permutation(n)]


def weighted_windows(items: Iterable[T], weights: Sequence[float], window: int,
                     rng: np.random.Generator) -> Iterator[T]:
    """Class-weighted resampling of each run of ``window`` items into as many items: the streaming counterpart of
    ``WeightedRandomSampler(replacement=True)``, with the epoch length (and so DDP step counts) unchanged."""
    buffer: list[T] = []

    def flush() -> Iterator[T]:
        labels = [item[1].label for item in buffer]
        for index in systematic_resample(labels, weights, rng):
            yield buffer[index]

    for item in items:
        buffer.append(item)
        if len(buffer) >= window:
            yield from flush()
            buffer = []
    if buffer:
        yield from flush()
