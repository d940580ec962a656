"""Streaming feature shards: the same epoch plan over ``features.json`` as image shards, one row per sample.

Most training on features runs in process (``shards.loader.in_process``: whole batches gathered from a
``FeatureStore``, ``feature_store()``); this per-sample ``IterableDataset`` serves a loader with worker processes,
and holds the shard loading (checked once per process, mmap'ed or held in memory) that both use.

A regression table (``task="regression"``, from ``features.json``'s ``config.target``) has no classes: both yield
its float32 ``targets`` where a classification folder yields labels, and nothing else about the order changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np
import torch

from shards.select.labels import shard_labels
from shards.stream.dataset import Selection, ShardDataset, StreamConfig
from shards.stream.worker_stream import StreamState
from shards.errors import CorruptDataError, InputError
from shards.formats.features import FeatureShard, FeatureSpec, check_feature_shard, load_checked, load_feature_shard
from shards.transport.location import Location, locate
from shards.manifest import SplitInfo
from shards.order.plan import ShardSlice
from shards.order.reads import CoveringReads
from shards.cache.cached_shards import CachedShards
from shards.stream.feature_store import FeatureStore

CACHE_MODES = ("auto", "memory", "none")
AUTO_CACHE_BYTES = 4 << 30
AHEAD_SHARDS = 64  # remote feature shards past the one being loaded offered for read-ahead, at most


class FeatureRow(NamedTuple):
    key: str
    label: int | float  # the class index, or a regression table's target
    features: torch.Tensor


class FeatureShardDataset(ShardDataset):
    """Feature shards -> ``(features[D], label[, key])`` per sample, with every guarantee of the image reader
    (``(features[D], target[, key])`` for a regression table)."""

    decode_timed = False  # a row is already the model input: its seconds are read, decode and transform stay 0
    ready_rows = True  # so the in-process run mode gathers whole batches of rows (``shards.loader.in_process``)

    def indexed_shards(self) -> list[bool]:
        """No feature shard is read through a byte index: a read costs about the rows' own bytes (the forecast)."""
        return [False] * len(self.locations)

    def __init__(self, split: SplitInfo, locations: Sequence[str], config: StreamConfig, *,
                 spec: FeatureSpec = FeatureSpec(None), cache: str = "auto", storage_options: Any = None,
                 shard_cache: CachedShards | None = None, selection: Selection = Selection()):
        """``spec``: what ``features.json`` promises (dim, dtype, classes, views; ``targets``: a regression
        table); ``features_dim=None`` (a caller without the manifest) takes each file's own."""
        super().__init__(split, locations, config, spec.num_classes, shard_cache, selection)
        self.task = "regression" if spec.targets else "classification"
        self.storage_options = storage_options  # for s3:// feature folders
        self.features_dim, self.dtype, self.views = spec.features_dim, spec.dtype, spec.views
        if cache not in CACHE_MODES:
            raise InputError(f"cache must be one of {list(CACHE_MODES)}, got {cache!r}")
        for location in self.locations:
            self._where(location).check_feature_shard()
        total_bytes = sum(s.bytes for s in split.shards)
        self.cache = cache if cache != "auto" else ("memory" if total_bytes <= AUTO_CACHE_BYTES else "none")
        self._shards: dict[int, FeatureShard] = {}
        self._remote_shards = any(self._where(location).local_path() is None for location in self.locations)
        self._verified: set[int] = set()  # shards whose size, sha256 and content matched features.json
        if selection.shard_labels and config.class_weights is not None:  # read once, before any epoch is ordered
            self.row_labels = shard_labels(self, len(config.class_weights))

    def shard(self, index: int) -> FeatureShard:
        """A shard, mmap'ed; kept for the life of this process copy when ``cache="memory"``.

        The file is untrusted: the first time this process copy loads it, its size and sha256 are checked against
        ``features.json`` (a bit flip in a value or label), then its shapes, dtype, keys and label range (a file
        written wrong with a matching manifest); a mismatch is a ``CorruptDataError`` naming the shard.
        """
        if index in self._shards:
            return self._shards[index]
        location, info = self.locations[index], self.split_info.shards[index]
        where = self._where(location)
        lease = self._cached_copy(index)
        if lease is not None:  # checked against the manifest's sha256 when fetched; read whole, then released
            with lease:
                loaded = load_feature_shard(str(lease.path), mmap=False, samples=info.samples)
        else:  # a local file mmap'ed, else fetched whole; size and sha256 checked first (once per process)
            loaded = load_checked(where, info, checked=index in self._verified)
        if index not in self._verified:
            dim = self.features_dim
            if dim is None:
                dim = loaded.features.shape[-1] if isinstance(loaded.features, torch.Tensor) else -1
            # No classes (a regression table): its labels are placeholders, with no range to check.
            spec = FeatureSpec(dim, self.dtype, self.num_classes or None, self.views, self.task == "regression")
            check_feature_shard(loaded, location, info.samples, spec)
            self._verified.add(index)
        mapping = self.label_maps[index] if self.label_maps is not None else None
        if mapping is not None:  # a mixture's source: its labels onto the combined classes
            loaded = relabel_shard(loaded, mapping, location)
        if self.cache == "memory" or where.local_path() is None or lease is not None:  # asked for, or read whole: held
            self._shards[index] = loaded
        return loaded

    def shards(self, indices: Sequence[int]) -> list[FeatureShard]:
        """``shard(i)`` for each of ``indices``, in order, with the next remote ones already in flight while one is
        loaded (``_read_ahead_shards``): over a real link a whole feature shard costs a round trip, so fetched one
        after another they are latency-bound (docs/object-storage.md)."""
        indices = list(indices)
        loaded = []
        for k, index in enumerate(indices):
            self._read_ahead_shards(indices[k:k + AHEAD_SHARDS])
            loaded.append(self.shard(index))
        return loaded

    def read_ahead(self, reads: CoveringReads, i: int, stream: StreamState) -> None:
        """Before covering read ``i``: the whole shards of it and the next reads in flight (a DataLoader worker
        reading feature shards from a remote store)."""
        if reads.shard(i) in self._shards or (i > 0 and reads.shard(i - 1) == reads.shard(i)):
            return  # loaded already, or offered when this shard's first read came
        ahead = dict.fromkeys(reads.shard(k) for k in range(i, min(len(reads), i + AHEAD_SHARDS)))
        self._read_ahead_shards(list(ahead))

    def _read_ahead_shards(self, indices: Sequence[int]) -> None:
        """Start fetching the remote feature shards among ``indices`` not loaded yet, in order, as far as the
        location's read-ahead budget allows (``Location.read_ahead_object``; the load takes the stream). Shards
        read through the node cache, and local ones, are left alone."""
        if not self._remote_shards:
            return
        for index in indices:
            if index in self._shards or self._through_cache(index):
                continue
            if not self._where(self.locations[index]).read_ahead_object(self.split_info.shards[index].bytes):
                break  # no room in the budget: offered again before a later load

    def _where(self, location: str) -> Location:
        """The location ``location`` names, reached with the caller's storage options."""
        return locate(location, storage_options=self.storage_options)

    def feature_store(self) -> FeatureStore:
        """The split's rows as one table indexed per batch (``shards.stream.feature_store``), read through this
        dataset's checked shard loading: the in-process run mode's view. Each call makes a new store (a loader keeps
        its own: a stacked table belongs to the run that uses it)."""
        return FeatureStore(self.shards, self.split_info.shard_sizes, targets=self.task == "regression",
                            keys=self.config.return_keys,
                            stacked=self.cache == "memory" and not self.config.feature_window)

    def read_slice(self, piece: ShardSlice) -> Iterator[FeatureRow]:
        shard = self.shard(piece.shard)
        block = shard.features[piece.start:piece.stop]
        for i, label in enumerate(self.values_of(shard)[piece.start:piece.stop].tolist()):
            yield FeatureRow(shard.keys[piece.start + i], label, block[i])

    def values_of(self, shard: FeatureShard) -> torch.Tensor:
        """What a sample pairs its features with: the labels, or a regression table's float32 targets."""
        return shard.targets if self.task == "regression" else shard.labels

    def decode(self, sample: FeatureRow, seed: int) -> torch.Tensor:
        return sample.features  # features are not augmented: the seed is not needed

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_shards"] = {}  # workers mmap their own copies
        return state


def relabel_shard(shard: FeatureShard, mapping: Any, where: str) -> FeatureShard:
    """``shard`` with its labels mapped through ``mapping`` (source class -> combined class)."""
    table = torch.as_tensor(np.asarray(mapping, dtype=np.int64))
    labels = shard.labels.long()
    if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= len(table)):
        raise CorruptDataError(f"a label is outside the source's {len(table)} classes", path=where)
    return dataclasses.replace(shard, labels=table[labels])
