"""``FeatureBatchLoader``: in-process batches over feature shards, one indexing call per batch.

Features are small and per-sample Python overhead, not the disk, is the limit (a DataLoader worker copying batches
between processes made a linear-head epoch 3-6x slower), so this loader runs in the main process with no workers:
it turns the rank's rows into one index tensor, permutes it fully, and gathers ``features[B, D]`` rows from memory
(``cache="memory"``) or from mmap'ed shards.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from shards.formats.features import FeatureShard, stack_rows
from shards.stream.feature_stream import FeatureShardDataset
from shards.stream.loader_base import Loader
from shards.stream.plan import STREAM_CLASS_WEIGHTS, rng_for
from shards.stream.resume import FEATURE_BATCHES
from shards.stream.stages import systematic_resample
from shards.stream.stage_times import zero_stages


class FeatureBatchLoader(Loader):
    """In-process batches ``(features[B, D], labels[B])`` (plus ``keys`` with ``return_keys``) for one rank; for a
    regression table ``(features[B, D], targets[B])``, float32.

    Order: the rank's rows (``shards.stream.order``, equal counts on every rank), resampled by class weight over the
    whole epoch when asked, then permuted whole from ``(seed, epoch, rank)``. ``state_dict`` counts batches, so a
    resumed run yields exactly the batches the interrupted epoch had left; with another world size or batch size,
    exactly the rows it had left, dealt to the new ranks (``shards.stream.elastic``).

    ``stage_seconds()``: the seconds spent planning the epoch's rows and gathering batches (loading shards on first
    use included) count as read, the one worker stage an in-process loader of ready rows has.
    """

    def __init__(self, dataset: FeatureShardDataset, batch_size: int, *, drop_last: bool = False,
                 stage_times: bool = True):
        super().__init__(dataset, batch_size, FEATURE_BATCHES, num_workers=0, drop_last=drop_last, split_batch=1)
        self.stage_times = stage_times
        # A plain float: only this loader's thread (or a prefetch thread) adds to it, no worker process does.
        self._read_s = 0.0
        self._table: FeatureShard | None = None
        self._key_list: list[str] | None = None
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
        for batch in range(start, self._batches(len(rows))):
            index = rows[batch * self.batch_size:(batch + 1) * self.batch_size]
            features, labels = self._gather(index)
            cursor.handed = before + batch + 1
            out = (features, labels)
            if self.dataset.config.return_keys:
                keys = self._keys()
                out = (features, labels, [keys[i] for i in index.tolist()])
            if clock:
                self._read_s += clock() - began
            yield out
            if clock:
                began = clock()
        if clock:
            self._read_s += clock() - began

    def _load_table(self) -> FeatureShard:
        if self._table is None:
            self._table = stack_rows([self.dataset.shard(i) for i in range(len(self.dataset.locations))])
        return self._table

    def _labels(self) -> torch.Tensor:
        if self.dataset.cache == "memory":
            return self._load_table().labels
        return torch.cat([self.dataset.shard(i).labels for i in range(len(self.dataset.locations))])

    def _keys(self) -> list[str]:
        if self.dataset.cache == "memory":
            return self._load_table().keys
        if self._key_list is None:
            self._key_list = [k for i in range(len(self.dataset.locations)) for k in self.dataset.shard(i).keys]
        return self._key_list

    def _gather(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values_of = self.dataset.values_of
        if self.dataset.cache == "memory":
            table = self._load_table()
            return table.features[index], values_of(table)[index]
        shard_of = np.searchsorted(self._offsets, index.numpy(), side="right") - 1
        features = labels = None
        for shard in np.unique(shard_of):
            mask = torch.from_numpy(shard_of == shard)
            loaded = self.dataset.shard(int(shard))
            local = index[mask] - int(self._offsets[shard])
            if features is None:
                features = loaded.features.new_empty((len(index), loaded.features.shape[1]))
                labels = values_of(loaded).new_empty(len(index))
            features[mask] = loaded.features[local]
            labels[mask] = values_of(loaded)[local]
        return features, labels
