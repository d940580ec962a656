"""``open_dataset(..., cache="memory")`` for image shards: decode each image once, serve later epochs from memory.

On a CPU, decoding and resizing are the whole cost of a fast-pipeline epoch (535-770 img/s per core, against
8,900-13,700 img/s for reading the shard bytes), and a dataset that fits in memory decodes the same files every
epoch. So the first epoch decodes as usual and keeps what it made in a ``SharedArrayStore`` (one mapping shared
by the main process and every DataLoader worker, gone when they are: ``shards.cache.shared_arrays``); later
epochs take it from there and skip decoding. What is kept, per preset, so that a cached epoch is bit for bit the
epoch a cold cache computes:

- ``eval``: the final uint8 [3, size, size] crop, which has no randomness; the same tensor the uncached pipeline
  yields.
- ``train``: the decoded image bounded to ``cache_side`` on its shorter side (default ``size / CROP_PCT``, the eval
  resize: 256 at 224), and RandomResizedCrop + flip applied to it with the sample's seed as today. The first epoch
  crops from the same bounded image (``FastTrain.source_side``), so every epoch sees one source, cached or not; it
  differs from cropping the full-resolution image (by resampling twice), which is why the cache is opt-in.

Only the fast pipeline (``Decode("fast")``) caches: its outputs are uint8, a quarter of the standard pipeline's
floats. Over the memory limit the cache keeps what fits (first come, first kept) and the rest is decoded every
epoch; the worker that finds the limit logs it once. The default limit is half of what this job has left
(``shards.cache.memory_budget``: the cgroup limit Slurm and containers set, else the RAM), less what other
caches of this process have planned. Each rank of a DDP job has its own cache of the samples it is dealt; with a
per-epoch shuffle across ranks a rank meets new samples for several epochs, so give each rank its
``memory_limit`` (``train-from-shards`` divides the default by the ranks on the node).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shards.cache.memory_budget import default_memory_limit, memory_view
from shards.cache.shared_arrays import ALIGN, FULL_NOW, HITS, MISSES, SharedArrayStore
from shards.errors import InputError
from shards.procs.decode_mark import mark_decoded
from shards.image.fast import DECODE_ERRORS, FastDecoder, undecodable
from shards.image.geometry import default_eval_resize
from shards.units import human_bytes, parse_size

log = logging.getLogger(__name__)

CACHE_MODES = ("auto", "memory", "none")  # as feature folders take them (shards.stream.feature_stream)
# The train cache plans room for images up to twice as long as they are wide on average (4:3 photos use 2/3 of it).
PLANNED_ASPECT = 2
_open_caches: "weakref.WeakSet[ImageCache]" = weakref.WeakSet()


def planned_bytes(spec: Any, samples: int, cache_side: int | None = None) -> int:
    """Room for every sample: exactly the crops for eval, ``cache_side`` x ``2 cache_side`` images for train
    (default side: the eval preset's resize, ``default_eval_resize``)."""
    if spec.preset == "eval":
        per_sample = 3 * spec.size * spec.size
    else:
        side = cache_side if cache_side is not None else default_eval_resize(spec.size)
        per_sample = 3 * side * side * PLANNED_ASPECT
    return samples * (-(-per_sample // ALIGN) * ALIGN)


@dataclass(frozen=True)
class ImageCacheRequest:
    """``open_dataset``'s ``cache`` (``"memory"`` or a ``MemoryCache(limit, side)``) for image shards, validated."""

    mode: str = "auto"
    memory_limit: int | str | None = None
    cache_side: int | None = None
    decode: str = "fast"

    def __post_init__(self) -> None:
        if self.mode not in CACHE_MODES:
            raise InputError(f"cache={self.mode!r} is not one of {', '.join(CACHE_MODES)}")
        if not self.enabled:
            if self.memory_limit is not None or self.cache_side is not None:
                raise InputError("memory_limit and cache_side size the decoded-image cache: pass cache='memory'")
            return
        if self.decode != "fast":
            raise InputError("cache='memory' on image shards needs decode=Decode('fast'): the standard pipeline's "
                             "float outputs would take 4x the memory")
        if self.memory_limit is not None:
            object.__setattr__(self, "memory_limit", parse_size(self.memory_limit, "memory_limit"))
        if self.cache_side is not None and (isinstance(self.cache_side, bool) or not isinstance(self.cache_side, int)
                                            or self.cache_side < 1):
            raise InputError(f"MemoryCache(side={self.cache_side!r}) must be a positive integer (pixels)")

    @property
    def enabled(self) -> bool:
        """``auto`` stays off for images: the train cache changes the augmentation source, so only on request."""
        return self.mode == "memory"

    def source_side(self, spec: Any) -> int | None:
        """The shorter side every train view is cropped from when caching (None: the image as decoded)."""
        if not self.enabled:
            return None
        if spec.preset != "train":
            if self.cache_side is not None:
                raise InputError("cache_side bounds the train preset's cached images; the eval preset caches its "
                                 "final crops")
            return None
        side = self.cache_side if self.cache_side is not None else default_eval_resize(spec.size)
        if side < spec.size:
            raise InputError(f"MemoryCache(side={side}) is smaller than the crop size {spec.size}")
        return side

    def open(self, decoder: Any, samples: int, where: str = "") -> "ImageCache | None":
        """The cache for ``samples`` samples, made in this (the main) process before any worker starts."""
        if not self.enabled:
            return None
        limit = self.memory_limit
        source = "memory_limit"
        if limit is None:
            view = memory_view()
            limit = default_memory_limit(reserved=sum(cache.unfilled() for cache in list(_open_caches)), view=view)
            source = f"half of the {human_bytes(view.available)} left of {human_bytes(view.limit)}, {view.source}"
        cache = ImageCache(decoder, samples, limit)
        log.info("image cache%s: %d samples, up to %s (limit %s: %s) in %s", f" for {where}" if where else "",
                 samples, human_bytes(cache.capacity), human_bytes(limit), source, cache.store.folder)
        return cache


class ImageCache:
    """The decode stage with a memory: ``cache(sample, seed, index)`` -> the fast decoder's output for that sample.

    ``index`` is the sample's global row in its split (the reader passes it), the cache key. It marks where
    decoding ended (``shards.procs.decode_mark``) as ``FastDecoder`` does, so stage timing counts a cached sample's work as transform:
    ``stage_seconds()["decode"]`` stops growing once every sample is cached.
    """

    def __init__(self, decoder: FastDecoder, samples: int, limit: int, folder: str | None = None):
        if not isinstance(decoder, FastDecoder):
            raise InputError("the image cache needs the fast pipeline's decoder (Decode('fast'))")
        self.keeps_output = decoder.spec.preset == "eval"
        if not self.keeps_output and decoder.source_side is None:
            raise InputError("a train cache keeps a bounded image: make the decoder with FastDecoder(spec, "
                             "source_side=...)")
        self.decoder = decoder
        self.limit = int(limit)
        self.capacity = min(self.limit, planned_bytes(decoder.spec, samples, decoder.source_side))
        self.store = SharedArrayStore(samples, self.capacity, folder)
        _open_caches.add(self)

    def __call__(self, sample: Any, seed: int, index: int) -> torch.Tensor:
        mark_decoded()  # a cached sample: nothing of the call counts as decoding
        geometry = self.decoder.geometry
        cached = self.store.get(index)
        if cached is not None:
            self.store.count(HITS)
            return torch.from_numpy(cached.copy()) if self.keeps_output else geometry.apply(cached, seed)
        self.store.count(MISSES)
        try:
            array = geometry.decode(sample.data)
            mark_decoded()
            output = geometry.apply(array, seed)
        except DECODE_ERRORS as exc:
            raise undecodable(sample, exc) from exc
        self._keep(index, output.numpy() if self.keeps_output else array)
        return output

    def _keep(self, index: int, array: np.ndarray) -> None:
        if self.store.put(index, array) == FULL_NOW:
            stats = self.store.stats()
            log.warning("image cache full at %s (limit %s): %d of %d samples cached, the rest are decoded every "
                        "epoch; raise memory_limit (--memory-limit) to cache them all",
                        human_bytes(stats["bytes"]), human_bytes(self.limit), stats["cached"], stats["samples"])

    def stats(self) -> dict[str, int]:
        """``samples``, ``cached``, ``bytes`` (used), ``capacity``, ``hits``, ``misses`` (decoded), ``full``: summed
        over every process using the cache."""
        return self.store.stats()

    def unfilled(self) -> int:
        """Bytes planned but not yet used: memory this cache may still take, which the job's use does not show."""
        return max(0, self.capacity - self.store.stats()["bytes"])

    def close(self) -> None:
        """Release this process's mapping now rather than when the dataset is collected."""
        self.store.close()
        _open_caches.discard(self)
