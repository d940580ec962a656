"""Putting feature shards together from the reader's batches, sample for sample with their image shards.

The training plan deals the rows of the shards to featurise to DataLoader workers in runs of whole loader batches,
so a loader batch may hold the end of one shard and the start of the next, and the rows of a shard may arrive from
two workers, its later rows first. The backbone, though, sees each shard as if it were read alone: chunks of
``batch_size`` rows counted from the shard's first row (a model's output for a sample can depend on what else is in
its batch, in the last bits). So rows wait in their chunk until it is whole, a whole chunk is featurised, and a
shard is handed on, as one ``FeatureShard`` in its manifest order, once its last chunk is done. What waits is at
most the chunks that straddle a loader batch or a worker's run (their inputs) and the features of shards whose
rows another worker still has to send.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from preprocess.features.loader import ShardJob
from shards.formats.features import FeatureShard

# (job, the chunk's pieces in row order) -> (features [n, D], views [n, K, D] or None), n the chunk's rows.
Featurise = Callable[[ShardJob, list[dict[str, Any]]], tuple[torch.Tensor, torch.Tensor | None]]


class FeatureAssembly:
    """Feature shards of ``jobs`` (in that order, one split of the reader) from batches of ``collate_rows``.

    ``featurise`` turns one whole chunk (its pieces, each a slice of a loader batch: ``rows``, ``labels``, ``keys``
    and the model inputs) into features; it is also called once with no pieces for a shard without samples.
    """

    def __init__(self, jobs: Sequence[ShardJob], batch_size: int, featurise: Featurise):
        self.jobs = list(jobs)
        self.batch_size = batch_size
        self.featurise = featurise
        sizes = [job.shard.samples for job in self.jobs]
        self.first_rows = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])[:-1]
        self._pieces: dict[tuple[int, int], list[dict[str, Any]]] = {}  # (job, chunk) -> pieces so far
        self._missing: dict[tuple[int, int], int] = {}  # (job, chunk) -> rows not yet arrived
        self._done: dict[int, dict[int, tuple]] = {}  # job -> chunk -> (features, views, labels, keys)

    def empty_shards(self) -> Iterator[tuple[ShardJob, "ShardParts"]]:
        """The shards without samples: no batch will ever name them."""
        for job in self.jobs:
            if job.shard.samples == 0:
                features, views = self.featurise(job, [])
                yield job, ShardParts([(features, views, torch.empty(0, dtype=torch.int64), [])])

    def add(self, batch: dict[str, Any]) -> Iterator[tuple[ShardJob, "ShardParts"]]:
        """Take one loader batch; yield the shards whose last chunk it completed."""
        rows = batch["rows"].numpy()
        positions = np.searchsorted(self.first_rows, rows, side="right") - 1
        local = rows - self.first_rows[positions]
        chunks = local // self.batch_size
        cuts = np.flatnonzero((np.diff(positions) != 0) | (np.diff(chunks) != 0)) + 1
        for start, stop in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)]):
            piece = {name: value[start:stop] for name, value in batch.items()}
            yield from self._arrived(int(positions[start]), int(chunks[start]), piece)

    def _arrived(self, position: int, chunk: int, piece: dict[str, Any]) -> Iterator[tuple[ShardJob, "ShardParts"]]:
        job = self.jobs[position]
        key = (position, chunk)
        if key not in self._missing:
            self._missing[key] = min(self.batch_size, job.shard.samples - chunk * self.batch_size)
        self._pieces.setdefault(key, []).append(piece)
        self._missing[key] -= len(piece["keys"])
        if self._missing[key] > 0:
            return
        del self._missing[key]
        pieces = sorted(self._pieces.pop(key), key=lambda p: int(p["rows"][0]))
        rows = torch.cat([p["rows"] for p in pieces]) - int(self.first_rows[position])
        if not torch.equal(rows, torch.arange(chunk * self.batch_size, chunk * self.batch_size + len(rows))):
            raise RuntimeError(f"{job.location}: rows {rows.tolist()} of chunk {chunk} arrived twice or not at all")
        features, views = self.featurise(job, pieces)
        done = self._done.setdefault(position, {})
        done[chunk] = (features, views, torch.cat([p["labels"] for p in pieces]),
                       [k for p in pieces for k in p["keys"]])
        if len(done) * self.batch_size >= job.shard.samples:  # every chunk of the shard is done
            del self._done[position]
            yield job, ShardParts([done[c] for c in sorted(done)])


class ShardParts:
    """One finished shard's chunks, in order: ``shard()`` joins them into a ``FeatureShard``.

    Joining is left to the caller's thread: the features of the last chunks may still be on their way from the
    device (``featurise`` may return values that ``resolve`` waits for), and the thread that writes the shard is the
    one that should wait, not the one feeding the device."""

    def __init__(self, chunks: list[tuple]):
        self.chunks = chunks

    def shard(self, resolve: Callable[[Any], torch.Tensor] = lambda value: value) -> FeatureShard:
        features, views, labels, keys = zip(*self.chunks)
        return FeatureShard(torch.cat([resolve(f) for f in features]), torch.cat(labels),
                            [k for part in keys for k in part],
                            None if views[0] is None else torch.cat([resolve(v) for v in views]))
