"""``FeatureBatchLoader``: in-process batches over feature shards, one indexing call per batch.

Features are small and per-sample Python overhead, not the disk, is the limit (a DataLoader worker copying batches
between processes made a linear-head epoch 3-6x slower), so this loader runs in the main process with no workers:
it turns the rank's rows into one index tensor, permutes it fully, and gathers ``features[B, D]`` rows from memory
(``cache="memory"``) or from mmap'ed shards. A whole permutation makes the first batch read every shard, so a cold
first epoch waits for the whole table; a windowed order (``Sampling.feature_window``) reads a few shards per window,
and a background thread (``shards.loader.feature_prefetch``) gathers the next window while this one trains.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from shards.formats.features import FeatureShard, stack_rows
from shards.loader.feature_prefetch import WindowsAhead, joined
from shards.stream.feature_stream import FeatureShardDataset
from shards.loader.base import Loader
from shards.order.plan import STREAM_CLASS_WEIGHTS, rng_for
from shards.position.resume import FEATURE_BATCHES
from shards.order.stages import systematic_resample
from shards.loader.stage_times import zero_stages


class FeatureBatchLoader(Loader):
    """In-process batches ``(features[B, D], labels[B])`` (plus ``keys`` with ``return_keys``) for one rank; for a
    regression table ``(features[B, D], targets[B])``, float32.

    Order: the rank's rows (``shards.order.order``, equal counts on every rank), resampled by class weight over the
    whole epoch when asked, then permuted from ``(seed, epoch, rank)``: whole, or within windows of
    ``feature_window`` rows, each gathered one window ahead on a background thread (batches are then slices of
    a window's block). ``state_dict`` counts batches, so a resumed run yields exactly the batches the interrupted
    epoch had left; with another world size or batch size, exactly the rows it had left, dealt to the new ranks
    (``shards.position.elastic``).

    ``stage_seconds()``: the seconds spent planning the epoch's rows and gathering batches (loading shards on first
    use included) count as read, the one worker stage an in-process loader of ready rows has; with a window, the
    seconds the caller waited for a window still being gathered (the gathering that overlapped training is not
    counted: it made no one wait).
    """

    def __init__(self, dataset: FeatureShardDataset, batch_size: int, *, drop_last: bool = False,
                 stage_times: bool = True):
        super().__init__(dataset, batch_size, FEATURE_BATCHES, num_workers=0, drop_last=drop_last, split_batch=1)
        self.stage_times = stage_times
        # A plain float: only this loader's thread (or a prefetch thread) adds to it, no worker process does.
        self._read_s = 0.0
        self._table: FeatureShard | None = None
        self._offsets = np.cumsum([0] + dataset.split_info.shard_sizes)

    def _batches(self, rows: int) -> int:
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def stage_seconds(self) -> dict[str, float]:
        """Seconds per worker stage since the last reset, all epochs: only ``read`` is ever non-zero."""
        return {**zero_stages(), "read": self._read_s}

    def reset_stage_seconds(self) -> None:
        self._read_s = 0.0

    def epoch_rows(self, epoch: int, left: np.ndarray | None = None) -> torch.Tensor:
        """Global row indices of this rank's epoch, in the order they are served (``left``: the rows an epoch
        continued in another layout has left)."""
        d = self.dataset
        c = d.config
        order = d.worker_order(epoch, 0, 1, left=left, whole=True)
        rows = order.rows
        if c.class_weights is not None and len(rows):
            labels = self._labels()[torch.from_numpy(rows)].numpy()
            rows = rows[systematic_resample(labels, c.class_weights, rng_for(c.seed, STREAM_CLASS_WEIGHTS, epoch,
                                                                                c.rank, 0))]
        return torch.from_numpy(order.served(rows).astype(np.int64))

    def __iter__(self) -> Iterator[tuple]:
        epoch = self.dataset.epoch
        cursor = self.cursor
        continued = cursor.begin()
        start = continued.position.layout_batches if continued is not None else 0
        before = cursor.batches_before()
        clock = time.perf_counter if self.stage_times else None
        began = clock() if clock else 0.0
        rows = self.epoch_rows(epoch, continued.left if continued is not None else None)
        window = self.dataset.config.feature_window
        ahead = WindowsAhead(lambda a, b: self._block(rows[a:b]), len(rows), window) if window else None
        try:
            for batch in range(start, self._batches(len(rows))):
                first, stop = batch * self.batch_size, min((batch + 1) * self.batch_size, len(rows))
                out = tuple(joined(ahead.pieces(first, stop)) if ahead is not None else self._block(rows[first:stop]))
                cursor.handed = before + batch + 1
                if clock:
                    self._read_s += clock() - began
                yield out
                if clock:
                    began = clock()
            if clock:
                self._read_s += clock() - began
        finally:  # finished, raised, or dropped by the caller: the read-ahead thread ends with the epoch
            if ahead is not None:
                ahead.close()

    def _block(self, index: torch.Tensor) -> list:
        """Rows ``index`` as ``[features, values]`` (plus their keys with ``return_keys``): one batch, or, for a
        windowed order, one window gathered on the read-ahead thread (the only caller of ``shard`` meanwhile).

        From the stacked table with ``cache="memory"`` and a whole permutation; otherwise shard by shard, each of
        the shards the rows live in loaded once (a windowed order loads no others)."""
        values_of = self.dataset.values_of
        keys = self.dataset.config.return_keys
        if self.dataset.cache == "memory" and not self.dataset.config.feature_window:
            table = self._load_table()
            return [table.features[index], values_of(table)[index]] + \
                ([[table.keys[i] for i in index.tolist()]] if keys else [])
        shard_of = np.searchsorted(self._offsets, index.numpy(), side="right") - 1
        wanted = [int(shard) for shard in np.unique(shard_of)]
        loaded = dict(zip(wanted, self.dataset.shards(wanted)))
        first = next(iter(loaded.values()))
        features = first.features.new_empty((len(index), first.features.shape[1]))
        values = values_of(first).new_empty(len(index))
        for shard, rows in loaded.items():
            mask = torch.from_numpy(shard_of == shard)
            local = index[mask] - int(self._offsets[shard])
            features[mask] = rows.features[local]
            values[mask] = values_of(rows)[local]
        if not keys:
            return [features, values]
        return [features, values, [loaded[int(s)].keys[row - int(self._offsets[s])]
                                   for s, row in zip(shard_of.tolist(), index.tolist())]]

    def _load_table(self) -> FeatureShard:
        if self._table is None:
            self._table = stack_rows(self.dataset.shards(range(len(self.dataset.locations))))
        return self._table

    def _labels(self) -> torch.Tensor:
        if self.dataset.cache == "memory" and not self.dataset.config.feature_window:
            return self._load_table().labels
        return torch.cat([shard.labels for shard in self.dataset.shards(range(len(self.dataset.locations)))])
