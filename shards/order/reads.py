"""Covering reads: a worker's rows, in order, as ranged reads of its shards that yield them in that order.

The plan says which rows a worker yields; this says how they are read. A subset, a mixture's partial pass or a
class-weighted draw leaves scattered rows, and reading each run of neighbours on its own costs a file open or a
ranged GET apiece, so nearby rows of one shard are read together and the rows between them passed over. The stream
(``shards.stream``), the forecast (``shards.forecast``) and ``shards.position.audit.row_keys`` all turn rows into
reads here, so they read alike.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from shards.order.plan import ShardSlice


class CoveringReads:
    """A worker's rows as reads: consecutive rows of one shard, each after the last one read, become one read of the
    range that covers them, with the positions to keep (None: all of it). ``len()``, ``shard(i)`` and ``reads[i]``
    (a ``(ShardSlice, keep)`` pair, made when asked for).

    A subset or a mixture's partial pass selects scattered rows, and one read per run of neighbours costs a file
    open, a ranged GET or, in a tar shard without an index, a walk of the headers from the start. ``max_gap(shard)``
    bounds the rows a merged read may pass over (None: no bound, for shards whose every read starts from byte 0).
    A row repeated in a row (a class-weighted draw of it several times) stays in the read, listed in ``keep`` as
    many times: the reader yields it that often instead of reading it again.
    Rows come out in the same order either way, so epochs, resume and augmentation seeds are unchanged. The reads
    are found with numpy and kept as arrays: a mixture at 1.28M rows has about one read per row, and a Python object
    for each before the first batch took seconds.
    """

    def __init__(self, rows: np.ndarray, offsets: np.ndarray, max_gap: Callable[[int], int | None]):
        rows = np.asarray(rows, dtype=np.int64)
        self._shards = np.searchsorted(offsets, rows, side="right") - 1
        self._local = rows - offsets[self._shards]
        if len(rows) == 0:
            self._starts = self._stops = np.zeros(0, dtype=np.int64)
            return
        unbounded = np.iinfo(np.int64).max
        limits = np.full(len(offsets), unbounded, dtype=np.int64)
        # bincount, not np.unique: the shards present in O(n), and no lazy import of numpy.ma in every worker
        for shard in np.flatnonzero(np.bincount(self._shards, minlength=len(offsets))).tolist():
            gap = max_gap(shard)
            limits[shard] = unbounded if gap is None else gap
        gaps = np.diff(self._local) - 1  # rows passed over between one row and the next (-1: the same row again)
        breaks = np.flatnonzero((np.diff(self._shards) != 0) | (gaps < -1) | (gaps > limits[self._shards[1:]])) + 1
        self._starts = np.concatenate([[0], breaks]).astype(np.int64)
        self._stops = np.concatenate([breaks, [len(rows)]]).astype(np.int64)

    def __len__(self) -> int:
        return len(self._starts)

    def shard(self, i: int) -> int:
        return int(self._shards[self._starts[i]])

    def __getitem__(self, i: int) -> tuple[ShardSlice, np.ndarray | None]:
        a, b = int(self._starts[i]), int(self._stops[i])
        first, last = int(self._local[a]), int(self._local[b - 1])
        whole = last - first + 1 == b - a and not np.any(self._local[a + 1:b] == self._local[a:b - 1])
        keep = None if whole else self._local[a:b] - first
        return ShardSlice(int(self._shards[a]), first, last + 1), keep

    def __iter__(self) -> Iterator[tuple[ShardSlice, np.ndarray | None]]:
        return (self[i] for i in range(len(self)))
