"""Feeding the backbone: the image shards a task featurises, read by the training reader and plan.

precompute-features has no reader of its own. The shards still to featurise become one split of the training reader
(``shards.stream.image_dataset.ImageShardDataset``: tar or HDF5 wherever ``shards.transport.location`` reaches, the
node cache with its prefetch when one is given, resync and label checks), read in manifest order (no shuffle) and
dealt to DataLoader workers by the training plan and loader (``shards.order.plan``, ``shards.loader.base``).
Its decoder is the ``--decode`` pipeline's step for one sample (``FeatureDecoder``), and every output carries its
row of that split, so the consumer (``preprocess.features.assembly``) puts each feature shard together sample for
sample, whichever worker read which rows. A sample that cannot be read or decoded stops the run with the reader's
``CorruptDataError`` naming shard and key.

Tars adopted in place (``shards index``) are read where the caller says (``--source``, ``shard_jobs``'s
``shards_at``, as ``Remote(base_url=...)`` sets it for training), by their row index, which stays in the dataset
folder (the reader's ``index_roots``): only the rows the index accepted, so the features hold the index's samples
in its order, its rejects left out.

The reader checks no sha256 on a slice of an ``s3://`` shard, nor on a local slice that is not the whole shard, so
``ShardReader.check_bytes`` vouches for a shard before its features are written: its node-cache copy (checked against
``dataset.json`` when it was fetched), else one hashed read of the whole shard (docs/design.md, section 6).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from preprocess.features.transforms import AugmentSpec, eval_fast, eval_pil, views_fast, views_pil
from shards.cache.cached_shards import CachedShards
from shards.cache.node import ShardCache
from shards.errors import CorruptDataError
from shards.transport.location import Location, locate
from shards.formats.sample import RawSample
from shards.image.transforms import TransformSpec
from shards.transport.storage import get_storage
from shards.image.decode import decode_image
from shards.image.device import exif_orientation
from shards.image.fast import decode_rgb_array
from shards.manifest import DatasetManifest, ShardInfo, SplitInfo
from shards.stream.dataset import StreamConfig
from shards.stream.image_dataset import ImageShardDataset
from shards.loader.loader import make_loader, workers_mode
from shards.loader.base import Loader
from shards.loader.budget import MemoryBudget


@dataclass(frozen=True)
class ShardJob:
    """One image shard to featurise, in the global order (sorted split names, then manifest shard order)."""

    index: int
    split: str
    shard: ShardInfo  # as dataset.json records it
    location: str  # where it is: a file in the dataset folder (or ``shards_at``), or an object under an s3:// prefix
    # Its feature file's name without suffix; None: its image shard's own stem (``train-000012``, as pack-shards
    # names shards). Tars adopted in place have names that are not ours: two folders may both hold ``0000.tar``.
    feature_stem: str | None = None


def shard_jobs(manifest: DatasetManifest, data_dir: Location | str, splits: tuple[str, ...] | None,
               shards_at: Location | str | None = None) -> list[ShardJob]:
    """Every image shard of the chosen splits, in a fixed order: sorted split names, then manifest shard order.
    ``shards_at``: where the shards are when not beside ``dataset.json`` (``--source``: tars adopted in place).
    Names are confined there (``Location.child``: a local shard symlinked out of the folder is refused). An adopted
    tar's features are named by its split and place in it (``train-000002``), unique whatever the tars are called."""
    source = locate(data_dir if shards_at is None else shards_at)
    adopted = get_storage(manifest.storage).load_index is not None
    names = sorted(manifest.splits) if splits is None else [s for s in sorted(manifest.splits) if s in splits]
    jobs: list[ShardJob] = []
    for split in names:
        for position, shard in enumerate(manifest.splits[split].shards):
            jobs.append(ShardJob(len(jobs), split, shard, source.child(shard.path, where=source.text).text,
                                 f"{split}-{position:06d}" if adopted else None))
    return jobs


def decodes_on_device(key: str, share: float) -> bool:
    """Whether sample ``key`` is decoded on the model's device when the device takes ``share`` of the decoding
    (``--device-share``): a fixed function of the key, never of timing, so a share gives the same features on every
    run, whatever the workers, batch size or machine."""
    if share >= 1.0:
        return True
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") < share * 2.0**64


@dataclass(frozen=True)
class FeatureDecoder:
    """The reader's decoder for featurising (``decoder(sample, seed)``): one sample's model inputs, by ``--decode``.

    ``standard`` (PIL and torchvision's exact reference ops) and ``fast`` (DCT-scaled decode, one crop-then-resize)
    give ``{"image": uint8 [3, crop, crop]}`` and, when augmenting, ``"views"``: uint8 [K, 3, crop, crop];
    normalisation happens per batch on the model's device. ``device`` gives the encoded bytes, their extension and
    EXIF orientation (``"image"`` None), decoded in batches on the model's device by the consumer; with
    ``device_share`` below 1 the samples ``decodes_on_device`` does not pick come decoded by the fast path instead
    (``"data"`` None), so CPU workers and the device share the decoding. Views are seeded by the sample's key
    (``transforms.view_rng``), never by the reader's ``seed``, so they do not depend on workers or batch size.
    """

    spec: TransformSpec
    augment: AugmentSpec | None
    decode: str
    device_share: float = 1.0
    # ``--decode auto`` on an accelerator: a shared double (``multiprocessing.RawValue``) the consumer sets as it
    # measures (``preprocess.features.decode_share``), read per sample in place of ``device_share``; each image the
    # workers decode then carries ``cpu_s``, the worker's CPU seconds for it.
    live_share: Any = field(default=None, compare=False)

    def __call__(self, sample: RawSample, seed: int = 0) -> dict[str, Any]:
        if self.decode != "device":
            return self._decoded(sample, fast=self.decode == "fast")
        live = self.live_share is not None
        if decodes_on_device(sample.key, self.live_share.value if live else self.device_share):
            jpeg = sample.ext.lower() in ("jpg", "jpeg")
            return {"image": None, "data": sample.data, "ext": sample.ext,
                    "orientation": exif_orientation(sample.data) if jpeg else 1, **({"cpu_s": None} if live else {})}
        began = time.thread_time()
        inputs = {**self._decoded(sample, fast=True), "data": None, "ext": sample.ext, "orientation": 1}
        return {**inputs, "cpu_s": time.thread_time() - began} if live else inputs

    def _decoded(self, sample: RawSample, *, fast: bool) -> dict[str, Any]:
        try:
            # Views crop from the full image: the DCT-scaled decode only for the eval crop alone.
            pixels = (decode_rgb_array(sample.data, None if self.augment is not None else self.spec.eval_resize) if fast
                      else _decoded_pil(sample.data))
        except Exception as exc:  # PIL and libjpeg raise several types for damaged bytes
            raise CorruptDataError(f"cannot decode .{sample.ext} image ({type(exc).__name__}: {exc})") from exc
        inputs = {"image": (eval_fast if fast else eval_pil)(pixels, self.spec)}
        if self.augment is not None:
            inputs["views"] = (views_fast if fast else views_pil)(pixels, self.spec, self.augment, sample.key)
        return inputs


def _decoded_pil(data: bytes):
    image = decode_image(data)
    image.load()  # decode the pixels here, where a failure is the sample's
    return image


class _RowTagged(ImageShardDataset):
    """The training reader, each output tagged with its row of the split: ``(row, inputs)``."""

    def decode_row(self, sample: RawSample, seed: int, row: int) -> tuple[int, Any]:
        return row, super().decode_row(sample, seed, row)


def collate_rows(items: Sequence[tuple]) -> dict[str, Any]:
    """A loader batch of ``((row, inputs), label, key)`` items: ``rows``, ``labels``, ``keys``, and each input by
    its name, stacked when every item's is a tensor (images, views), else listed (bytes, extensions,
    orientations, and images when the device decodes some of them)."""
    batch: dict[str, Any] = {"rows": torch.tensor([row for (row, _), _, _ in items], dtype=torch.int64),
                             "labels": torch.tensor([label for _, label, _ in items], dtype=torch.int64),
                             "keys": [key for _, _, key in items]}
    for name in items[0][0][1]:
        values = [inputs[name] for (_, inputs), _, _ in items]
        batch[name] = torch.stack(values) if all(isinstance(v, torch.Tensor) for v in values) else values
    return batch


class ShardReader:
    """How this run reads its image shards: the dataset's storage format and classes, the caller's storage options
    (for ``s3://``) and node cache (``shards.cache.node.ShardCache``, or None: none), and the dataset folder
    (``index_root``), where a format that keeps its index with the manifest (adopted tars) has it."""

    def __init__(self, storage: str, num_classes: int, storage_options: Any = None, cache: ShardCache | None = None,
                 index_root: str | None = None, memory: MemoryBudget | None = None):
        self.storage, self.num_classes, self.storage_options = storage, num_classes, storage_options
        self.memory = memory  # the loader's memory budget (``shards.loader.budget``; None: its default)
        self.index_root = index_root
        self.shard_cache = None if cache is None else CachedShards(cache, storage_options)
        # Checks run on a thread beside the reader, which reads in this process too when there are no DataLoader
        # workers: a handle of their own on the same cache, not sharing the reader's prefetches.
        self._check_cache = None if cache is None else CachedShards(cache, storage_options)

    def check_locations(self, jobs: Sequence[ShardJob]) -> None:
        """Refuse, before anything is written, a shard the reader cannot read from where it is (a missing local
        file; a missing object on ``s3://`` is a 404 when read)."""
        storage = get_storage(self.storage)
        for job in jobs:
            locate(job.location, storage_options=self.storage_options).check_image_shard(storage)

    def dataset(self, jobs: Sequence[ShardJob], decoder: FeatureDecoder) -> ImageShardDataset:
        """The jobs' shards as one split of the training reader, in job order, yielding ``((row, inputs), label,
        key)``."""
        shards = tuple(job.shard for job in jobs)
        counts = [0] * self.num_classes  # of the shards that record theirs (the reader only weights by them)
        for shard in shards:
            for label, count in enumerate(shard.class_counts or ()):
                counts[label] += count
        split = SplitInfo(sum(s.samples for s in shards), tuple(counts), shards)
        config = StreamConfig(split="+".join(dict.fromkeys(job.split for job in jobs)), shuffle=False,
                              return_keys=True)
        return _RowTagged(split, [job.location for job in jobs], config, storage=self.storage, decoder=decoder,
                          num_classes=self.num_classes, storage_options=self.storage_options,
                          shard_cache=self.shard_cache, index_roots=[self.index_root] * len(jobs))

    def loader(self, jobs: Sequence[ShardJob], decoder: FeatureDecoder, *, batch_size: int, workers: int,
               pin_memory: bool) -> Loader:
        """Batches of ``collate_rows`` over the jobs, from at most ``workers`` DataLoader workers (the training
        plan deals each a run of whole batches)."""
        dataset = self.dataset(jobs, decoder)
        batches = -(-dataset.split_info.samples // batch_size)
        return make_loader(dataset, batch_size, mode=workers_mode(min(workers, batches), persistent=False),
                           drop_last=False, collate_fn=collate_rows, pin_memory=pin_memory, stage_times=False,
                           memory=self.memory)

    def check_bytes(self, job: ShardJob) -> None:
        """Raise ``ChecksumError`` (naming the shard) unless the shard's bytes match ``dataset.json``'s size and
        sha256: its node-cache copy, checked when it was fetched (and by this process before its first use), else
        one hashed read of the whole shard from where it is."""
        cache = self._check_cache
        if cache is not None and cache.cached(job.location):
            lease = cache.lease(job.location, job.shard.sha256, job.shard.bytes)
            if lease is not None:
                lease.release()
                return
        locate(job.location, storage_options=self.storage_options).check(job.shard.bytes, job.shard.sha256)
