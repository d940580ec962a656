"""Feeding the backbone: one image shard is one unit of work, read in order and cut into batches inside workers.

Shards are dealt to DataLoader workers round-robin; each worker reads its shards sequentially with the storage's
own reader and yields batches that never span two shards, tagged with the shard's job index and an ``last`` flag,
so the consumer can write a feature shard as soon as its final batch arrives, sample for sample in shard order.
Workers either decode and transform to uint8 (``decode="fast"``: DCT-scaled decode and one crop-then-resize;
``decode="cpu"``: PIL and torchvision's exact reference ops) or only read bytes and the EXIF orientation
(``decode="gpu"``: the consumer decodes the batch on the model's device). A sample that cannot be decoded is
reported as an error record rather than raised inside the worker, so the user gets one clean line naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from preprocess.features.transforms import AugmentSpec, FeatureTransform, eval_fast, eval_pil, views_fast, views_pil
from shards.image.decode import decode_image
from shards.image.fast import decode_rgb_array
from shards.image.device import exif_orientation
from shards.formats.locations import local_shard_path
from shards.formats.storage import get_storage

DECODE_MODES = ("fast", "cpu", "gpu")


@dataclass(frozen=True)
class ShardJob:
    """One image shard to featurise, in the global deterministic order (split order, then shard order)."""

    index: int
    split: str
    name: str  # the path as the dataset manifest records it
    path: str  # where it is on disk
    samples: int
    sha256: str


class ShardBatches(IterableDataset):
    """Batches of one shard at a time; each worker takes every ``num_workers``-th job."""

    def __init__(self, jobs: list[ShardJob], storage: str, *, batch_size: int, spec: FeatureTransform,
                 augment: AugmentSpec | None, decode: str):
        super().__init__()
        self.jobs = jobs
        self.storage = storage
        self.batch_size = batch_size
        self.spec = spec
        self.augment = augment
        self.decode = decode

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for job in self.jobs[worker::workers]:
            try:
                yield from self._shard_batches(job)
            except _SampleError as exc:
                yield {"job": job.index, "error": str(exc.__cause__ or exc), "key": exc.key}
                return
            except Exception as exc:  # a damaged shard: reported by the consumer with the shard's path
                yield {"job": job.index, "error": f"{type(exc).__name__}: {exc}", "key": None}
                return

    def _shard_batches(self, job: ShardJob) -> Iterator[dict[str, Any]]:
        pending: list = []
        for sample in get_storage(self.storage).read(job.path):
            pending.append(sample)
            if len(pending) == self.batch_size:
                yield self._batch(job, pending, last=False)
                pending = []
        yield self._batch(job, pending, last=True)

    def _batch(self, job: ShardJob, samples: list, *, last: bool) -> dict[str, Any]:
        batch: dict[str, Any] = {
            "job": job.index,
            "last": last,
            "keys": [s.key for s in samples],
            "labels": torch.tensor([s.label for s in samples], dtype=torch.int64),
        }
        if self.decode == "gpu":
            batch["datas"] = [s.data for s in samples]
            batch["exts"] = [s.ext for s in samples]
            batch["orientations"] = [exif_orientation(s.data) if s.ext.lower() in ("jpg", "jpeg") else 1
                                     for s in samples]
            return batch
        images, views = [], []
        for sample in samples:
            if self.decode == "fast":
                self._add_fast(sample, images, views)
                continue
            try:
                image = decode_image(sample.data)
            except Exception as exc:
                raise _SampleError(sample.key) from exc
            images.append(eval_pil(image, self.spec))
            if self.augment is not None:
                views.append(views_pil(image, self.spec, self.augment, sample.key))
        crop = self.spec.crop
        batch["images"] = torch.stack(images) if images else torch.empty(0, 3, crop, crop, dtype=torch.uint8)
        if self.augment is not None:
            batch["views"] = (torch.stack(views) if views
                              else torch.empty(0, self.augment.views, 3, crop, crop, dtype=torch.uint8))
        return batch


    def _add_fast(self, sample, images: list, views: list) -> None:
        """``--decode fast``: DCT-scaled decode (unless views need full resolution), crop-then-resize to uint8."""
        try:
            array = decode_rgb_array(sample.data, None if self.augment is not None else self.spec.resize)
        except Exception as exc:
            raise _SampleError(sample.key) from exc
        images.append(eval_fast(array, self.spec))
        if self.augment is not None:
            views.append(views_fast(array, self.spec, self.augment, sample.key))


class _SampleError(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def make_loader(dataset: ShardBatches, *, workers: int, pin_memory: bool) -> DataLoader:
    """Worker-side batching (``batch_size=None``): batches already hold one shard's consecutive samples."""
    workers = min(workers, len(dataset.jobs))
    return DataLoader(dataset, batch_size=None, num_workers=workers, pin_memory=pin_memory,
                      prefetch_factor=4 if workers else None, persistent_workers=False)


def shard_jobs(manifest, data_dir: Path, splits: tuple[str, ...] | None) -> list[ShardJob]:
    """Every image shard of the chosen splits, in a fixed order: sorted split names, then manifest shard order."""
    names = sorted(manifest.splits) if splits is None else [s for s in sorted(manifest.splits) if s in splits]
    jobs: list[ShardJob] = []
    for split in names:
        for shard in manifest.splits[split].shards:
            path = local_shard_path(data_dir, shard.path)  # refuses a symlink out of the dataset folder
            jobs.append(ShardJob(len(jobs), split, shard.path, str(path), shard.samples, shard.sha256))
    return jobs
