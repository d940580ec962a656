"""A split's feature table as the in-process loader reads it: rows by global index, one gather per batch.

The in-process run mode (``shards.loader.in_process``) turns a whole batch of global rows into one index tensor and
gathers ``features[B, D]`` at once, where the per-sample stream (``shards.stream.feature_stream``) yields one row at
a time through DataLoader workers. Both read the same checked shards; the store only decides how a batch's rows are
reached: from one stacked table (``cache="memory"`` with a whole permutation: every shard is read anyway), or shard
by shard, each shard the rows live in loaded once (a windowed order touches a few shards per window).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from shards.formats.features import FeatureShard, stack_rows

ShardLoad = Callable[[Sequence[int]], list]  # shard indices -> their FeatureShards, in order, checked


class FeatureStore:
    """Rows of one split's feature shards by global row (shards in manifest order, rows in file order).

    ``load``: the dataset's checked shard loading (``FeatureShardDataset.shards``); ``targets``: a regression table
    (values are float32 targets, not labels); ``keys``: batches carry their keys; ``stacked``: gather from one
    table of every shard (loaded on first use, then kept) rather than shard by shard."""

    def __init__(self, load: ShardLoad, shard_sizes: Sequence[int], *, targets: bool, keys: bool, stacked: bool):
        self._load = load
        self._offsets = np.cumsum([0, *shard_sizes])
        self.targets, self.keys, self.stacked = targets, keys, stacked
        self._table: FeatureShard | None = None

    def values_of(self, shard: FeatureShard) -> torch.Tensor:
        """What a row pairs its features with: the labels, or a regression table's float32 targets."""
        return shard.targets if self.targets else shard.labels

    def rows(self, index: torch.Tensor) -> list:
        """Rows ``index`` (global, int64) as ``[features, values]`` (plus their keys when the store carries keys), in
        the order asked: one batch, or one window of a windowed order."""
        if self.stacked:
            table = self._whole()
            return [table.features[index], self.values_of(table)[index]] + \
                ([[table.keys[i] for i in index.tolist()]] if self.keys else [])
        shard_of = np.searchsorted(self._offsets, index.numpy(), side="right") - 1
        wanted = [int(shard) for shard in np.unique(shard_of)]
        loaded = dict(zip(wanted, self._load(wanted)))
        first = next(iter(loaded.values()))
        features = first.features.new_empty((len(index), first.features.shape[1]))
        values = self.values_of(first).new_empty(len(index))
        for shard, rows in loaded.items():
            mask = torch.from_numpy(shard_of == shard)
            local = index[mask] - int(self._offsets[shard])
            features[mask] = rows.features[local]
            values[mask] = self.values_of(rows)[local]
        if not self.keys:
            return [features, values]
        return [features, values, [loaded[int(s)].keys[row - int(self._offsets[s])]
                                   for s, row in zip(shard_of.tolist(), index.tolist())]]

    def _whole(self) -> FeatureShard:
        if self._table is None:
            self._table = stack_rows(self._load(range(len(self._offsets) - 1)))
        return self._table
