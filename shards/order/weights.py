"""Class weighting, a step of the order (docs/design.md, "The order model and resume"): the epoch's stream
resampled by each row's class weight before any rank or worker takes its share.

The scope is the whole epoch's stream, not a window of what one worker happened to read, so that:
- the draws do not depend on the number of DataLoader workers, nor on which loader runs (the in-process feature
  loader and worker processes deal the same weighted stream);
- an interrupted epoch's remainder is the stream positions not yet yielded, whatever the layout, so elastic resume
  and lineage replay the weighted order with no step of their own (a row drawn twice is two positions);
- the epoch's class frequencies are as close to the weights as whole draws allow: one systematic pass gives every
  row the floor or ceiling of its expected count.
The draws keep the stream's order (a row drawn twice is listed twice in a row, which one covering read yields twice,
and the reads still walk the shards front to back); the shuffle buffer or permutation after it mixes them. The labels come from the split's
column index (``shards.select.labels``), so the order is known before any shard is read and a resumed worker skips
without reading.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from shards.order.plan import STREAM_CLASS_WEIGHTS, rng_for


def class_weights_from_counts(class_counts: Sequence[int]) -> list[float]:
    """Inverse frequency: every class present gets the same expected share; absent classes get weight 0."""
    return [0.0 if count == 0 else 1.0 / count for count in class_counts]


def systematic_resample(labels: np.ndarray, weights: Sequence[float], rng: np.random.Generator) -> np.ndarray:
    """Positions of ``len(labels)`` draws, each position drawn in proportion to its class weight, ascending (the
    input's order kept, a position drawn ``k`` times listed ``k`` times). Low variance: a position's count is the
    floor or ceiling of its expected count, from one uniform offset."""
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    item_weights = np.asarray(weights, dtype=np.float64)[labels]
    total = item_weights.sum()
    if n == 0 or total <= 0:  # nothing of a weighted class in this stream: it stays as it is
        return np.arange(n, dtype=np.int64)
    edges = np.cumsum(item_weights) * (n / total)
    points = rng.random() + np.arange(n)
    return np.minimum(np.searchsorted(edges, points, side="right"), n - 1).astype(np.int64)


def weighted_stream(rows: np.ndarray, labels: np.ndarray, weights: Sequence[float], *, seed: int,
                    epoch: int) -> np.ndarray:
    """The epoch's ``rows`` (global rows, stream order) resampled by ``weights[labels[row]]``: as many draws, in
    stream order, from ``(seed, epoch)`` only."""
    rows = np.asarray(rows, dtype=np.int64)
    picked = systematic_resample(labels[rows], weights, rng_for(seed, STREAM_CLASS_WEIGHTS, epoch))
    return rows[picked]
