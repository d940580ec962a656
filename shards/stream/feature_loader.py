"""``FeatureBatchLoader``: in-process batches over feature shards, one indexing call per batch.

Features are small and per-sample Python overhead, not the disk, is the limit (a DataLoader worker copying batches
between processes made a linear-head epoch 3-6x slower), so this loader runs in the main process with no workers:
it turns the rank's rows into one index tensor, permutes it fully, and gathers ``features[B, D]`` rows from memory
(``cache="memory"``) or from mmap'ed shards.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
import torch

from shards.errors import InputError
from shards.formats.features import FeatureShard, stack_rows
from shards.stream.elastic import Continuation, continuation, permuted_rows
from shards.stream.feature_stream import FeatureShardDataset
from shards.stream.plan import STREAM_CLASS_WEIGHTS, STREAM_SHUFFLE_BUFFER, rng_for
from shards.stream.resume import FEATURE_BATCHES, LoaderState, consumed_batches
from shards.stream.stages import systematic_resample
from shards.stream.stage_times import zero_stages


class FeatureBatchLoader:
    """In-process batches ``(features[B, D], labels[B])`` (plus ``keys`` with ``return_keys``) for one rank; for a
    regression table ``(features[B, D], targets[B])``, float32.

    Order: the rank's planned rows (equal counts on every rank), resampled by class weight over the whole epoch
    when asked, then fully permuted from ``(seed, epoch, rank)``. ``state_dict`` counts batches, so a resumed run
    yields exactly the batches the interrupted epoch had left; with another world size or batch size, exactly the
    rows it had left, dealt to the new ranks (``shards.stream.elastic``).

    ``stage_seconds()``: the seconds spent planning the epoch's rows and gathering batches (loading shards on first
    use included) count as read, the one worker stage an in-process loader of ready rows has.
    """

    num_workers = 0  # by design: see the module docstring

    def __init__(self, dataset: FeatureShardDataset, batch_size: int, *, drop_last: bool = False,
                 stage_times: bool = True):
        if batch_size < 1:
            raise InputError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.stage_times = stage_times
        # A plain float: only this loader's thread (or a prefetch thread) adds to it, no worker process does.
        self._read_s = 0.0
        self._table: FeatureShard | None = None
        self._key_list: list[str] | None = None
        self._offsets = np.cumsum([0] + dataset.split_info.shard_sizes)
        self._consumed = 0  # batches handed out in the current epoch
        self._pending: Continuation | None = None  # a loaded position, for the next iteration only
        self._active: Continuation | None = None  # the current iteration's, when it reads a remainder

    def __len__(self) -> int:
        """Batches of this epoch, counting those handed out before a resume in another layout."""
        remainder = self._remainder()
        if remainder is None:
            return self._batches(len(self.dataset))
        return remainder.position.prior["batches"] + self._batches(len(remainder.rank_indices))

    def _batches(self, rows: int) -> int:
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def _remainder(self) -> Continuation | None:
        """The continuation whose remainder the current (or next) iteration of this epoch reads, if any."""
        continued = self._pending if self._pending is not None else self._active
        if continued is not None and continued.rank_indices is not None \
                and continued.position.epoch == self.dataset.epoch:
            return continued
        return None

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def stage_seconds(self) -> dict[str, float]:
        """Seconds per worker stage since the last reset, all epochs: only ``read`` is ever non-zero."""
        return {**zero_stages(), "read": self._read_s}

    def reset_stage_seconds(self) -> None:
        self._read_s = 0.0

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """The position in the current epoch: after the batches handed out, or after ``batches_consumed`` of them
        when the consumer lags behind (a prefetch thread draws ahead of the training step)."""
        remainder = self._remainder()
        prior = remainder.position.prior if remainder is not None else None
        return self._position(consumed_batches(batches_consumed, self._consumed), prior).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch at the next batch it had not yet handed out (in another layout: over the rows
        the interrupted epoch had not yet yielded)."""
        d = self.dataset
        self._pending = continuation(state, self._position(0), d.epoch_source(), d.config.rank)
        self._consumed = self._pending.position.batches
        d.set_epoch(self._pending.position.epoch)

    def _position(self, batches: int, prior: dict[str, Any] | None = None) -> LoaderState:
        return self.dataset.loader_state(FEATURE_BATCHES, batches, batch_size=self.batch_size,
                                         num_workers=self.num_workers, drop_last=self.drop_last, split_batch=1,
                                         prior=prior)

    def epoch_rows(self, epoch: int) -> torch.Tensor:
        """Global row indices of this rank's epoch, in the order they are served."""
        d = self.dataset
        c = d.config
        remainder = self._remainder()
        if remainder is not None and remainder.position.epoch == epoch:
            return torch.from_numpy(permuted_rows(remainder.rank_indices, d.epoch_source(), epoch, c.rank).copy())
        pieces = d.worker_plan(epoch, 0, 1)
        rows = np.concatenate([np.arange(p.start, p.stop) + self._offsets[p.shard] for p in pieces] or [[]])
        rows = rows.astype(np.int64)
        if c.class_weights is not None and len(rows):
            labels = self._labels()[torch.from_numpy(rows)].numpy()
            rows = rows[systematic_resample(labels, c.class_weights, rng_for(c.seed, STREAM_CLASS_WEIGHTS, epoch,
                                                                                c.rank, 0))]
        if c.shuffle:
            rows = rows[rng_for(c.seed, STREAM_SHUFFLE_BUFFER, epoch, c.rank, 0).permutation(len(rows))]
        return torch.from_numpy(rows)

    def __iter__(self) -> Iterator[tuple]:
        epoch = self.dataset.epoch
        pending, self._pending = self._pending, None
        continues = pending is not None and pending.position.epoch == epoch
        self._active = pending if continues and pending.rank_indices is not None else None
        start = pending.position.batches if continues else 0
        before = self._active.position.prior["batches"] if self._active is not None else 0
        self._consumed = start
        clock = time.perf_counter if self.stage_times else None
        began = clock() if clock else 0.0
        rows = self.epoch_rows(epoch)
        for batch in range(start - before, self._batches(len(rows))):
            index = rows[batch * self.batch_size:(batch + 1) * self.batch_size]
            features, labels = self._gather(index)
            self._consumed = before + batch + 1
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
