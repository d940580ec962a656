"""Feeding the backbone: one image shard is one unit of work, read in order and cut into batches inside workers.

Shards are dealt to DataLoader workers round-robin; each worker reads its shards sequentially with the storage's
own reader and yields batches that never span two shards, tagged with the shard's job index and an ``last`` flag,
so the consumer can write a feature shard as soon as its final batch arrives, sample for sample in shard order.
Workers either decode and transform to uint8 (``decode="fast"``: DCT-scaled decode and one crop-then-resize;
``decode="standard"``: PIL and torchvision's exact reference ops) or only read bytes and the EXIF orientation
(``decode="device"``: the consumer decodes the batch on the model's device). A sample that cannot be decoded is
reported as an error record rather than raised inside the worker, so the user gets one clean line naming it.

A dataset on object storage (``s3://bucket/prefix``) is read the same way, one shard per job: a tar shard in one
streaming GET parsed by ``iter_tar_stream`` (its size and sha256 checked against ``dataset.json`` before the
shard's last batch is handed on, so features of other bytes are never written), an HDF5 shard through the
block-cached ``S3File`` (``shards.formats.s3shards``). Requests use the caller's ``S3Options``.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from preprocess.features.transforms import AugmentSpec, FeatureTransform, eval_fast, eval_pil, views_fast, views_pil
from shards.image.decode import decode_image
from shards.image.fast import decode_rgb_array
from shards.image.device import exif_orientation
from shards.errors import ChecksumError, InputError
from shards.formats.locations import local_shard_path, shard_location
from shards.formats.storage import get_storage

@dataclass(frozen=True)
class ShardJob:
    """One image shard to featurise, in the global deterministic order (split order, then shard order)."""

    index: int
    split: str
    name: str  # the path as the dataset manifest records it
    path: str  # where it is: a local file, or an s3:// URL under the dataset's prefix
    samples: int
    sha256: str
    bytes: int = -1  # the shard's size as dataset.json records it


class ShardBatches(IterableDataset):
    """Batches of one shard at a time; each worker takes every ``num_workers``-th job."""

    def __init__(self, jobs: list[ShardJob], storage: str, *, batch_size: int, spec: FeatureTransform,
                 augment: AugmentSpec | None, decode: str, storage_options: Any = None, shard_cache: Any = None):
        super().__init__()
        self.storage_options = storage_options  # S3Options for s3:// jobs (picklable: no credentials)
        self.shard_cache = shard_cache  # a CachedShards, or None: read every shard from its source
        self.jobs = jobs
        self.storage = storage
        self.batch_size = batch_size
        self.spec = spec
        self.augment = augment
        self.decode = decode

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        try:
            yield from self._jobs(self.jobs[worker::workers])
        finally:
            if self.shard_cache is not None:
                self.shard_cache.drop_prefetched()

    def _jobs(self, mine: list[ShardJob]) -> Iterator[dict[str, Any]]:
        for position, job in enumerate(mine):
            if self.shard_cache is not None and position + 1 < len(mine):
                self._prefetch(mine[position + 1])  # the next shard downloads while this one is decoded
            try:
                yield from self._shard_batches(job)
            except _SampleError as exc:
                yield {"job": job.index, "error": str(exc.__cause__ or exc), "key": exc.key}
                return
            except InputError as exc:  # 403, 404, no credentials: the user's to fix (exit 2), not a damaged shard
                yield {"job": job.index, "error": " ".join(exc.reason.split()), "key": None,
                       "input_error": exc.path or job.path}
                return
            except Exception as exc:  # a damaged shard: reported by the consumer with the shard's path
                yield {"job": job.index, "error": f"{type(exc).__name__}: {exc}", "key": None}
                return

    def _cacheable(self, job: ShardJob) -> bool:
        return self.shard_cache is not None and job.bytes >= 0 and self.shard_cache.cached(job.path)

    def _prefetch(self, job: ShardJob) -> None:
        if self._cacheable(job):
            self.shard_cache.prefetch(job.path, job.sha256, job.bytes)

    def _shard_batches(self, job: ShardJob) -> Iterator[dict[str, Any]]:
        lease = None
        if self._cacheable(job):
            lease = self.shard_cache.lease(job.path, job.sha256, job.bytes)  # checked against the manifest
        try:
            yield from self._read_batches(job, None if lease is None else str(lease.path))
        finally:
            if lease is not None:
                lease.release()

    def _read_batches(self, job: ShardJob, cached: str | None) -> Iterator[dict[str, Any]]:
        pending: list = []
        storage = get_storage(self.storage)
        remote = job.path.startswith("s3://") and cached is None
        # A format that streams is read in one GET, hashed as it goes; one that seeks (HDF5) by ranges.
        stream = _HashingReader(job, self.storage_options) if remote and storage.read_stream is not None else None
        if cached is not None:
            samples = storage.read(cached)
        elif stream is not None:
            samples = storage.read_stream(io.BufferedReader(stream, 1 << 20), job.path)
        elif remote:
            samples = storage.read_s3_slice(job.path, 0, job.samples, self.storage_options, size=job.bytes)
        else:
            samples = storage.read(job.path)
        try:
            for sample in samples:
                pending.append(sample)
                if len(pending) == self.batch_size:
                    yield self._batch(job, pending, last=False)
                    pending = []
            if stream is not None:
                stream.check()
        finally:
            if stream is not None:
                stream.close()
        yield self._batch(job, pending, last=True)

    def _batch(self, job: ShardJob, samples: list, *, last: bool) -> dict[str, Any]:
        batch: dict[str, Any] = {
            "job": job.index,
            "last": last,
            "keys": [s.key for s in samples],
            "labels": torch.tensor([s.label for s in samples], dtype=torch.int64),
        }
        if self.decode == "device":
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


class _HashingReader(io.RawIOBase):
    """A tar shard on S3 as one streaming GET, hashed on the way; ``check`` reads what the parser left (the end-of-
    archive blocks) and compares size and sha256 with ``dataset.json``."""

    def __init__(self, job: ShardJob, options: Any = None):
        from shards.formats.s3_ranges import open_range

        super().__init__()
        self.job = job
        self.stream = open_range(job.path, 0, None, options)
        self.digest = hashlib.sha256()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.stream.read(len(buffer))
        buffer[: len(data)] = data
        self.digest.update(data)
        self.size += len(data)
        return len(data)

    def check(self) -> None:
        while self.read(1 << 20):
            if self.job.bytes >= 0 and self.size > self.job.bytes:
                break
        if self.job.bytes >= 0 and self.size != self.job.bytes:
            raise ChecksumError(f"{'more than ' if self.size > self.job.bytes else ''}{self.size} bytes, "
                                f"dataset.json records {self.job.bytes} (truncated or replaced)", path=self.job.path)
        if self.digest.hexdigest() != self.job.sha256:
            raise ChecksumError("sha256 does not match dataset.json (corrupt or replaced)", path=self.job.path)

    def close(self) -> None:
        self.stream.close()
        super().close()


class _SampleError(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def make_loader(dataset: ShardBatches, *, workers: int, pin_memory: bool) -> DataLoader:
    """Worker-side batching (``batch_size=None``): batches already hold one shard's consecutive samples."""
    workers = min(workers, len(dataset.jobs))
    return DataLoader(dataset, batch_size=None, num_workers=workers, pin_memory=pin_memory,
                      prefetch_factor=4 if workers else None, persistent_workers=False)


def shard_jobs(manifest, data_dir: Path | str, splits: tuple[str, ...] | None) -> list[ShardJob]:
    """Every image shard of the chosen splits, in a fixed order: sorted split names, then manifest shard order.
    ``data_dir`` may be an ``s3://bucket/prefix``: shard names become object keys under it."""
    names = sorted(manifest.splits) if splits is None else [s for s in sorted(manifest.splits) if s in splits]
    remote = str(data_dir).startswith("s3://")
    jobs: list[ShardJob] = []
    for split in names:
        for shard in manifest.splits[split].shards:
            if remote:
                path = shard_location(str(data_dir), shard.path, where=str(data_dir))
            else:
                path = str(local_shard_path(data_dir, shard.path))  # refuses a symlink out of the dataset folder
            jobs.append(ShardJob(len(jobs), split, shard.path, path, shard.samples, shard.sha256, shard.bytes))
    return jobs
