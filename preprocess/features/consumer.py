"""``precompute-features``' consumer: loader batches -> model inputs on the device -> features -> shard files, as a
pipeline in which the slowest stage sets the rate, not the sum of the stages.

On a GPU node the stages are: prepare (move the workers' uint8 crops to the device, or decode and crop JPEG bytes
there: ``--decode device``), forward, the copy of the features back to the host, and the write. Run in series in one
thread (as before issue 45) a batch's forward waited for its decode, the next decode for the forward's copy back
(``.cpu()`` is a host sync), and the write for both: 0.19x of the backbone's forward rate on an H200
(docs/gpu.md). Here:

- prepare runs on a side CUDA stream (``shards.image.side_stream``), so the device decodes and crops chunk n+1
  while it runs the forward of chunk n; the forward's stream waits for it with an event, never the host;
- the features are copied back into pinned host memory without a host sync (``HostCopy``); the thread that waits
  for them is the writer's, which then checks and writes the shard, so the main thread only queues device work
  and does the assembly's bookkeeping (numpy over a batch's row numbers: no per-sample Python);
- at most ``MAX_UNWRITTEN`` finished shards wait for the writer: the bound on what the pipeline holds.

Off CUDA the same code runs every stage in line (streams and events are absent), which is what the tests run.
``RunStats.stages`` keeps each stage's seconds as the thread that runs it sees them (``scripts/bench/feed.py``
prints them per image).
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from preprocess.features.assembly import FeatureAssembly, ShardParts
from preprocess.features.backbones import Backbone
from preprocess.features.config import AMP_MODES, DTYPES, FeatureConfig
from preprocess.features.decode_share import SplitMeter, live_split
from preprocess.features.feature_stats import FeatureStats, check_shard
from preprocess.features.loader import FeatureDecoder, ShardJob, ShardReader
from preprocess.features.state import feature_path, write_shard_record
from preprocess.features.transforms import AugmentSpec, eval_tensors, views_tensors
from shards.atomic import check_room
from shards.errors import CorruptDataError
from shards.formats.features import FeatureShard, write_feature_shard
from shards.image.checked_decode import CheckedDecoder, DecodeCheck
from shards.image.device import Normalize
from shards.image.side_stream import SideStreamCopy
from shards.image.transforms import TransformSpec
from shards.jobs.preemption import Preempted, StopRequest
from shards.jobs.progress import progress
from shards.manifest import ShardInfo

MAX_UNWRITTEN = 4  # finished shards waiting for their check and write: their features are held in memory
STAGES = ("wait", "prepare", "forward", "assemble", "copy_back", "write")


@dataclass
class RunStats:
    images: int = 0
    shards_done: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    stages: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    extra: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.stages[stage] += time.perf_counter() - began


class FeatureExtractor:
    """uint8 batches on the device -> penultimate features in the output dtype: on the device (``forward``, no host
    sync) or on the host (calling it: ``forward`` then ``.cpu()``)."""

    def __init__(self, backbone: Backbone, spec: TransformSpec, device: torch.device, amp: str, dtype: str,
                 batch_size: int):
        cuda = device.type == "cuda"
        self.model = backbone.model.to(device, memory_format=torch.channels_last if cuda else torch.preserve_format)
        self.normalize = Normalize(spec.mean, spec.std, channels_last=cuda).to(device)
        self.device, self.amp, self.dtype = device, AMP_MODES[amp], DTYPES[dtype]
        self.dim, self.batch_size = backbone.features_dim, batch_size

    def forward(self, images: torch.Tensor, stats: FeatureStats | None = None) -> torch.Tensor:
        """``stats``: where the rows are counted (``preprocess.features.feature_stats``), before and after the cast."""
        outputs = [torch.empty(0, self.dim, dtype=self.dtype, device=self.device)]
        for chunk in images.split(self.batch_size):
            autocast = (torch.autocast(self.device.type, dtype=self.amp) if self.amp is not None
                        else contextlib.nullcontext())
            with torch.inference_mode(), autocast:
                features = self.model(self.normalize(chunk.to(self.device, non_blocking=True)))
            stored = features.float().to(self.dtype)
            if stats is not None:
                stats.update(features.float(), stored)
            outputs.append(stored)
        return torch.cat(outputs)

    def __call__(self, images: torch.Tensor, stats: FeatureStats | None = None) -> torch.Tensor:
        return self.forward(images, stats).cpu()


@dataclass
class HostCopy:
    """A device tensor's copy into pinned host memory, queued on the current stream; ``get`` waits for it (the
    writer thread calls it), so queuing it never holds up the thread that feeds the device."""

    tensor: torch.Tensor
    ready: Any = None  # a torch.cuda.Event, or None where the tensor was on the host already

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "HostCopy":
        if tensor.device.type != "cuda":
            return cls(tensor.cpu())
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(host, ready)

    def get(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensor


def resolve(value: Any) -> torch.Tensor:
    return value.get() if isinstance(value, HostCopy) else value


def _model_inputs(job: ShardJob, pieces: list[dict[str, Any]], spec: TransformSpec,
                  augment: AugmentSpec | None, decoder: CheckedDecoder) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's uint8 model inputs on the device (its pieces moved there, then joined); with ``--decode device``
    decoded (``decoder``: checked against the CPU, ``shards.image.checked_decode``) and cropped there. No pieces: a
    shard without samples."""
    crop, device = spec.size, decoder.device
    if not pieces:
        empty = torch.empty(0, 3, crop, crop, dtype=torch.uint8, device=device)
        no_views = None if augment is None else torch.empty(0, augment.views, 3, crop, crop, dtype=torch.uint8)
        return empty, no_views
    if "data" not in pieces[0]:
        def joined(name: str) -> torch.Tensor:
            return torch.cat([p[name].to(device, non_blocking=True) for p in pieces])
        return joined("image"), None if augment is None else joined("views")
    keys = [k for p in pieces for k in p["keys"]]
    datas = [d for p in pieces for d in p["data"]]
    on_device = [i for i, data in enumerate(datas) if data is not None]
    exts = [e for p in pieces for e in p["ext"]]
    orientations = [o for p in pieces for o in p["orientation"]]
    try:
        decoded = decoder([datas[i] for i in on_device], [exts[i] for i in on_device],
                          [orientations[i] for i in on_device], [keys[i] for i in on_device])
    except CorruptDataError as exc:
        raise CorruptDataError(exc.reason, path=job.location, key=exc.key) from exc
    views = None if augment is None else views_tensors(decoded, keys, spec, augment)
    if len(on_device) == len(datas):
        return eval_tensors(decoded, spec), views
    # device_share < 1: the workers decoded the other images; both go into the batch in row order.
    images = torch.empty(len(datas), 3, crop, crop, dtype=torch.uint8, device=device)
    by_workers = [image for p in pieces for image in p["image"] if image is not None]
    images[[i for i, data in enumerate(datas) if data is None]] = torch.stack(by_workers).to(device,
                                                                                            non_blocking=True)
    if on_device:
        images[on_device] = eval_tensors(decoded, spec)
    return images, views


def _write_job(cfg: FeatureConfig, job: ShardJob, shard: FeatureShard, digest: str,
               stats: FeatureStats | None = None) -> None:
    path = feature_path(cfg.out_dir, job, cfg.storage)
    if cfg.storage == "hdf5":  # HDF5 crashes on a disk that fills up under it: refused before (shards.atomic)
        check_room(cfg.out_dir, _tensor_bytes(shard) + sum(len(k) + 16 for k in shard.keys), path.name)
    size, sha256 = write_feature_shard(path, shard, cfg.storage)
    info = ShardInfo(path.name, len(shard), size, sha256, source=job.shard.path, source_sha256=job.shard.sha256)
    write_shard_record(cfg.out_dir, job, cfg.storage, info, digest, None if stats is None else stats.to_record())


def _tensor_bytes(shard: FeatureShard) -> int:
    """The bytes of a feature shard's tensors (features, labels, views, targets)."""
    tensors = (shard.features, shard.labels, shard.views, shard.targets)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _decoder(cfg: FeatureConfig, spec: TransformSpec, augment: AugmentSpec | None,
             meter: SplitMeter | None) -> FeatureDecoder:
    """``--decode``'s per-sample step; under ``auto`` the device path, its share read live from ``meter``."""
    if meter is None:
        return FeatureDecoder(spec, augment, cfg.decode, cfg.device_share)
    return FeatureDecoder(spec, augment, "device", live_share=meter.live)


def featurize_jobs(cfg: FeatureConfig, jobs: list[ShardJob], reader: ShardReader, extractor: FeatureExtractor,
                   spec: TransformSpec, augment: AugmentSpec | None, digest: str, stop: StopRequest) -> RunStats:
    """Features of every job's shard, each checked (``reader.check_bytes``) and written on the writer thread while
    the next ones are computed, at most ``MAX_UNWRITTEN`` shards waiting; a failed check or write stops the run at
    the next batch. A stop signal stops it after the batch in flight: the shards finished by then are still written,
    the one in progress is left to the rerun (``Preempted``)."""
    stats = RunStats()
    checked = CheckedDecoder(extractor.device, DecodeCheck(every=cfg.decode_check, seed=cfg.seed))
    side = SideStreamCopy(extractor.device)  # prepare on a side stream, beside the forward before it
    shard_stats: dict[int, FeatureStats] = {}  # job index -> its rows' statistics, until its shard is written

    meter = live_split(cfg.decode, cfg.workers, extractor.device)  # --decode auto: the measured split, else None
    timed = (lambda name: contextlib.nullcontext()) if meter is None else meter.span
    def featurise(job: ShardJob, pieces: list[dict[str, Any]]) -> tuple[HostCopy, HostCopy | None]:
        with stats.timing("prepare"):
            with side.copying(), timed("decode"):
                images, views = _model_inputs(job, pieces, spec, augment, checked)
            side.hand_over(*(t for t in (images, views) if t is not None))
        with stats.timing("forward"):
            rows = shard_stats.setdefault(job.index, FeatureStats(extractor.dim, extractor.device))
            with timed("forward"):
                features = HostCopy.of(extractor.forward(images, rows))
            if meter is not None:
                meter.chunk_done(pieces)
            if views is None:
                return features, None
            flat = extractor.forward(views.flatten(0, 1))
            return features, HostCopy.of(flat.view(len(images), cfg.views, extractor.dim))

    def finish(job: ShardJob, parts: ShardParts) -> None:
        with stats.timing("copy_back"):
            shard = parts.shard(resolve)
        with stats.timing("write"):
            reader.check_bytes(job)  # the bytes read were dataset.json's, before anything is made of them
            rows = shard_stats.pop(job.index)
            check_shard(rows, str(feature_path(cfg.out_dir, job, cfg.storage)))  # NaN/inf: refused before written
            _write_job(cfg, job, shard, digest, rows)

    loader = reader.loader(jobs, _decoder(cfg, spec, augment, meter), batch_size=cfg.batch_size,
                           workers=cfg.workers, pin_memory=extractor.device.type == "cuda")
    assembly = FeatureAssembly(jobs, cfg.batch_size, featurise)
    unwritten: list[Future] = []

    def settle(wait_for: int) -> None:
        """Take the results of the shards written so far (raising what a check or write raised), and wait while
        more than ``wait_for`` are still to be written."""
        while unwritten and (unwritten[0].done() or len(unwritten) > wait_for):
            unwritten.pop(0).result()
            stats.shards_done += 1

    bar = progress(total=sum(job.shard.samples for job in jobs), desc="features", unit="img", quiet=cfg.quiet)
    start = time.perf_counter()
    batches = iter(loader)
    # The loader closed on the way out, an error included: its workers stop now, not at garbage collection.
    with loader, bar, ThreadPoolExecutor(1, thread_name_prefix="precompute-write") as writer:
        unwritten += [writer.submit(finish, job, parts) for job, parts in assembly.empty_shards()]
        while True:
            with stats.timing("wait"):
                batch = next(batches, None)
            if batch is None:
                break
            began, inside = time.perf_counter(), stats.stages["prepare"] + stats.stages["forward"]
            unwritten += [writer.submit(finish, job, parts) for job, parts in assembly.add(batch)]
            stats.stages["assemble"] += (time.perf_counter() - began
                                         - (stats.stages["prepare"] + stats.stages["forward"] - inside))
            settle(MAX_UNWRITTEN)
            bar.update(len(batch["keys"]))
            stats.images += len(batch["keys"])
            if stop:
                break
        settle(0)
    stats.wall_s = time.perf_counter() - start
    stats.wait_s = stats.stages["wait"]
    if stop:
        raise _preempted(cfg, stop, jobs, stats)
    if cfg.decode in ("device", "auto"):
        stats.extra["decode_check"] = checked.record()
    if meter is not None:
        stats.extra["decode_share"] = meter.controller.record()
    return stats


def _preempted(cfg: FeatureConfig, stop: StopRequest, jobs: list[ShardJob], stats: RunStats) -> Preempted:
    """Where a rerun of the same command starts: the shards not written yet (a shard is the unit of resume:
    ``preprocess.features.state``)."""
    return Preempted(f"stopped by {stop.signal_name}: {stats.shards_done} of this run's {len(jobs)} shards written "
                     f"in {cfg.out_dir}; the same command again featurises the other {len(jobs) - stats.shards_done} "
                     f"(the one in progress from its first image)", stop.signal_name or "")
