"""``precompute-features``: a frozen backbone's penultimate features, one feature file per image shard.

The config hash covers what changes the numbers: backbone, weights sha256 (or the init seed of a random init),
transform, augmentation and views, output dtype, the resolved AMP mode, the resolved decoder (``pil``,
``decode_jpeg:cpu`` or ``decode_jpeg:cuda``: nvjpeg's pixels differ slightly from libjpeg's; ``@S+fast`` when
``device_share`` S leaves the other images to the workers' fast path) and the file format.
Device, batch size and worker count are not in it (they change speed, not features beyond float noise) and are
recorded as provenance instead. The dataset is wherever ``shards.transport.location`` reaches (a local folder, an
``s3://bucket/prefix`` read with ``storage_options``): ``dataset_dir`` records where, ``dataset_sha256`` is the
sha256 of the very ``dataset.json`` bytes the shards to featurise were listed from. The shards of an index of tars
adopted in place (``shards index``) are read from ``shard_source`` (``--source``), the caller's choice like every
reader's (``Remote(base_url=...)``); it is provenance, not config: the tars' checksums say they are the same bytes.

The image shards are read by the training reader (``preprocess.features.loader``) and their features put together
shard by shard (``preprocess.features.assembly``); a finished shard is checked against ``dataset.json`` and
written on a thread beside the backbone. Resume state and the assembly of ``features.json`` live in
``preprocess.features.state``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from preprocess.features.backbones import Backbone, build_backbone
from preprocess.features.assembly import FeatureAssembly
from preprocess.features.loader import FeatureDecoder, ShardJob, ShardReader, shard_jobs
from preprocess.features.state import (CONFIG_RECORD, STATE_DIR, assemble_manifest, check_output, config_hash, feature_path,
                                      finished_shard, prepare_output, read_config_record, write_shard_record)
from preprocess.features.transforms import AugmentSpec, eval_tensors, transform_record, views_tensors
from shards.jobs.devices import resolve_device
from shards.image.device import Normalize, decode_images
from shards.image.options import DEFAULT_INTERPOLATION, IMAGENET_MEAN, IMAGENET_STD
from shards.image.transforms import TransformSpec
from shards.atomic import check_local_output, check_room, remove_stale_tmp
from shards.errors import CorruptDataError, InputError, ShardcacheError
from shards.lock import claim_output
from shards.stream.options import DECODES
from shards.formats.feature_names import FEATURE_SUFFIXES
from shards.formats.features import FeatureShard, write_feature_shard
from shards.transport.location import Location, locate
from shards.door.locations import check_dataset_dir
from shards.transport.manifest_io import read_dataset_manifest
from shards.transport.s3 import S3Options
from shards.transport.storage import get_storage
from shards.manifest import FEATURES_FILE, DatasetManifest, FeatureManifest, ShardInfo
from shards.jobs.progress import progress

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "float32": torch.float32}
AMP_MODES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}
MAX_UNWRITTEN = 4  # finished shards waiting for their check and write: their features are held in memory


@dataclass(frozen=True)
class FeatureConfig:
    """Everything one ``precompute-features`` task needs; transform fields left None come from the weights."""

    data_dir: Path | str  # a local folder, or an s3://bucket/prefix (``source``: where, as a location)
    out_dir: Path
    backbone: str = "resnet50"
    weights: str = "none"
    seed: int = 0
    resize: int | None = None
    crop: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    interpolation: str | None = None
    views: int = 0
    augment: bool = False
    dtype: str = "float16"
    storage: str = "pt"
    device: str = "auto"
    amp: str = "auto"
    decode: str = "fast"
    device_share: float = 1.0  # with decode="device": the share of images decoded there; workers do the rest
    batch_size: int = 64
    workers: int = 2
    splits: tuple[str, ...] | None = None
    task_index: int = 0
    num_tasks: int = 1
    overwrite: bool = False
    quiet: bool = False
    storage_options: Any = None  # S3Options (or a mapping of its fields) for an s3:// data_dir
    cache: Any = None  # a shards.cache.node.ShardCache: keep fetched image shards on this node's disk
    shard_source: Path | str | None = None  # where the shards are when not beside dataset.json (adopted tars)
    source: Location = field(init=False, repr=False, compare=False)
    shards_at: Location | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_local_output(self.out_dir)  # before Path(), which turns s3://b/x into s3:/b/x
        places = [self.data_dir] + ([] if self.shard_source is None else [self.shard_source])
        if any(locate(place).uses_storage_options for place in places):
            object.__setattr__(self, "storage_options", S3Options.from_mapping(self.storage_options))
        object.__setattr__(self, "source", locate(self.data_dir, storage_options=self.storage_options))
        object.__setattr__(self, "shards_at", None if self.shard_source is None
                           else locate(self.shard_source, storage_options=self.storage_options))
        check_dataset_dir(_recorded(self.source))  # what features.json may record: a local folder or s3:// prefix
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        choices = {"dtype": DTYPES, "storage": FEATURE_SUFFIXES, "decode": DECODES,
                   "amp": (*AMP_MODES, "auto")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"{name} {getattr(self, name)!r} is not one of {sorted(allowed)}")
        if self.batch_size < 1 or self.workers < 0 or self.views < 0:
            raise InputError(f"batch_size {self.batch_size} must be >= 1, workers {self.workers} and "
                             f"views {self.views} >= 0")
        if bool(self.views) != self.augment:
            raise InputError("--views K and --augment go together: K augmented views per image need both")
        if not 0.0 <= self.device_share <= 1.0:
            raise InputError(f"device_share {self.device_share} must be between 0 and 1")
        if self.device_share < 1.0 and (self.decode != "device" or self.augment):
            raise InputError(f"device_share {self.device_share} splits --decode device's decoding with the workers; "
                             f"it needs decode 'device' (not {self.decode!r}) and no --augment")
        if self.num_tasks < 1 or not 0 <= self.task_index < self.num_tasks:
            raise InputError(f"task index {self.task_index} is not in [0, {self.num_tasks})")
        if self.source.is_local and self.source.path.resolve() == self.out_dir.resolve():
            raise InputError("--out must differ from the dataset folder", path=str(self.out_dir))
        if self.shards_at is not None and self.shards_at.is_local \
                and self.shards_at.path.resolve() == self.out_dir.resolve():
            raise InputError("--out must differ from the --source folder", path=str(self.out_dir))


@dataclass
class RunStats:
    images: int = 0
    shards_done: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_transform(cfg: FeatureConfig, backbone: Backbone) -> TransformSpec:
    """Options override the weights' own eval preset, which overrides the ImageNet default (resize 256, crop 224)."""
    base = dict(backbone.eval_preset or {"resize": 256, "crop": 224, "mean": IMAGENET_MEAN, "std": IMAGENET_STD,
                                         "interpolation": DEFAULT_INTERPOLATION})
    if cfg.crop is not None and cfg.resize is None:  # keep the preset's resize/crop ratio
        base["resize"] = round(cfg.crop * base["resize"] / base["crop"])
    for name in ("resize", "crop", "mean", "std", "interpolation"):
        if getattr(cfg, name) is not None:
            base[name] = getattr(cfg, name)
    spec = TransformSpec(preset="eval", size=int(base["crop"]), resize_size=int(base["resize"]),
                         mean=tuple(base["mean"]), std=tuple(base["std"]), interpolation=str(base["interpolation"]))
    if backbone.input_size is not None and spec.size != backbone.input_size:
        raise InputError(f"{backbone.name} takes {backbone.input_size}px inputs only; --crop is {spec.size}")
    return spec


def _recorded(source: Location) -> str:
    """``dataset_dir`` as this folder records it: a local folder resolved (symlinks followed, as every run has
    recorded it: a rerun must find the same), any other location as given, without a trailing ``/``."""
    return str(source.path.resolve()) if source.is_local else source.record().rstrip("/")


def _run_record(cfg: FeatureConfig, backbone: Backbone, spec: TransformSpec, device: torch.device,
                splits: list[str]) -> dict[str, Any]:
    amp = ("bf16" if device.type == "cuda" else "off") if cfg.amp == "auto" else cfg.amp
    # The record names the decoder that made the pixels, not the option: on the device, nvjpeg's differ from libjpeg's.
    decoder = {"fast": "fast", "standard": "pil"}.get(cfg.decode, f"decode_jpeg:{device.type}")
    if cfg.device_share < 1.0:  # which images the device decodes is a function of the share: part of the numbers
        decoder += f"@{cfg.device_share:g}+fast"
    augment = AugmentSpec(cfg.views, seed=cfg.seed) if cfg.augment else None
    config = {
        "backbone": backbone.name,
        "weights_sha256": backbone.weights_sha256,
        "init_seed": backbone.init_seed,
        "transform": transform_record(spec),
        "augment": augment.to_dict() if augment else None,
        "views": cfg.views,
        "dtype": cfg.dtype,
        "amp": amp,
        "decode": decoder,
        "storage": cfg.storage,
    }
    return {
        "config": config,
        "config_hash": config_hash(config),
        "dataset_dir": _recorded(cfg.source),
        "splits": splits,
        "features_dim": backbone.features_dim,
        "provenance": {"weights": backbone.weights, "device": str(device), "batch_size": cfg.batch_size,
                       "workers": cfg.workers, "num_tasks": cfg.num_tasks,
                       **({} if cfg.shards_at is None else {"source": _recorded(cfg.shards_at)})},
    }


class FeatureExtractor:
    """uint8 batches on the device -> penultimate features on the CPU, in the output dtype."""

    def __init__(self, backbone: Backbone, spec: TransformSpec, device: torch.device, amp: str, dtype: str,
                 batch_size: int):
        cuda = device.type == "cuda"
        self.model = backbone.model.to(device, memory_format=torch.channels_last if cuda else torch.preserve_format)
        self.normalize = Normalize(spec.mean, spec.std, channels_last=cuda).to(device)
        self.device, self.amp, self.dtype = device, AMP_MODES[amp], DTYPES[dtype]
        self.dim, self.batch_size = backbone.features_dim, batch_size

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        outputs = [torch.empty(0, self.dim, dtype=self.dtype)]
        for chunk in images.split(self.batch_size):
            autocast = (torch.autocast(self.device.type, dtype=self.amp) if self.amp is not None
                        else contextlib.nullcontext())
            with torch.inference_mode(), autocast:
                features = self.model(self.normalize(chunk.to(self.device, non_blocking=True)))
            outputs.append(features.float().to(self.dtype).cpu())
        return torch.cat(outputs)


def _model_inputs(job: ShardJob, pieces: list[dict[str, Any]], spec: TransformSpec,
                  augment: AugmentSpec | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's uint8 model inputs on the device (its pieces moved there, then joined); with ``--decode device``
    decoded and cropped there. No pieces: a shard without samples."""
    crop = spec.size
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
        decoded = decode_images([datas[i] for i in on_device], [exts[i] for i in on_device],
                                [orientations[i] for i in on_device], device, keys=[keys[i] for i in on_device])
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


def _write_job(cfg: FeatureConfig, job: ShardJob, shard: FeatureShard, digest: str) -> None:
    path = feature_path(cfg.out_dir, job, cfg.storage)
    if cfg.storage == "hdf5":  # HDF5 crashes on a disk that fills up under it: refused before (shards.atomic)
        check_room(cfg.out_dir, _tensor_bytes(shard) + sum(len(k) + 16 for k in shard.keys), path.name)
    size, sha256 = write_feature_shard(path, shard, cfg.storage)
    info = ShardInfo(path.name, len(shard), size, sha256, source=job.shard.path, source_sha256=job.shard.sha256)
    write_shard_record(cfg.out_dir, job, cfg.storage, info, digest)


def _tensor_bytes(shard: FeatureShard) -> int:
    """The bytes of a feature shard's tensors (features, labels, views, targets)."""
    tensors = (shard.features, shard.labels, shard.views, shard.targets)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _featurize(cfg: FeatureConfig, jobs: list[ShardJob], reader: ShardReader, extractor: FeatureExtractor,
               spec: TransformSpec, augment: AugmentSpec | None, digest: str) -> RunStats:
    """Features of every job's shard, each checked (``reader.check_bytes``) and written on a thread while the next
    ones are computed, at most ``MAX_UNWRITTEN`` shards waiting; a failed check or write stops the run at the next
    batch."""

    def featurise(job: ShardJob, pieces: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        images, views = _model_inputs(job, pieces, spec, augment, extractor.device)
        features = extractor(images)
        if views is None:
            return features, None
        return features, extractor(views.flatten(0, 1)).view(len(features), cfg.views, extractor.dim)

    def finish(job: ShardJob, shard: FeatureShard) -> None:
        reader.check_bytes(job)  # the bytes read were dataset.json's, before anything is made of them
        _write_job(cfg, job, shard, digest)

    stats = RunStats()
    loader = reader.loader(jobs, FeatureDecoder(spec, augment, cfg.decode, cfg.device_share), batch_size=cfg.batch_size,
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
        unwritten += [writer.submit(finish, job, shard) for job, shard in assembly.empty_shards()]
        while True:
            waited = time.perf_counter()
            batch = next(batches, None)
            stats.wait_s += time.perf_counter() - waited
            if batch is None:
                break
            unwritten += [writer.submit(finish, job, shard) for job, shard in assembly.add(batch)]
            settle(MAX_UNWRITTEN)
            bar.update(len(batch["keys"]))
            stats.images += len(batch["keys"])
        settle(0)
    stats.wall_s = time.perf_counter() - start
    return stats


def run_precompute(cfg: FeatureConfig) -> tuple[FeatureManifest | None, dict[str, Any]]:
    """Featurise this task's unfinished shards; write ``features.json`` if every shard is then done."""
    dataset, dataset_sha256 = read_dataset_manifest(cfg.source)
    unknown = sorted(set(cfg.splits or ()) - set(dataset.splits))
    if unknown:
        raise InputError(f"no split(s) {unknown} in dataset.json (it has {sorted(dataset.splits)})",
                         path=cfg.source.text)
    if get_storage(dataset.storage).load_index is not None and cfg.shards_at is None:
        raise InputError("indexes tars adopted in place (shards index): give --source, the folder holding them",
                         path=cfg.source.text)
    backbone = build_backbone(cfg.backbone, cfg.weights, seed=cfg.seed)
    spec = resolve_transform(cfg, backbone)
    device = resolve_device(cfg.device)
    jobs = shard_jobs(dataset, cfg.source, cfg.splits, cfg.shards_at)
    mine = [job for job in jobs if job.index % cfg.num_tasks == cfg.task_index]
    reader = ShardReader(dataset.storage, len(dataset.classes), cfg.storage_options, cfg.cache, cfg.source.text)
    reader.check_locations(mine)
    record = _run_record(cfg, backbone, spec, device, sorted({job.split for job in jobs}))
    # Every file of the finished folder, whichever task writes it: what --overwrite may not write over unless the
    # old output names it.
    writes = {feature_path(cfg.out_dir, job, cfg.storage).name for job in jobs} | {FEATURES_FILE}
    check_output(cfg.out_dir, record, overwrite=cfg.overwrite, writes=writes)  # refuse before even a lock file
    with claim_output(cfg.out_dir, STATE_DIR, what="precompute-features", task=(cfg.task_index, cfg.num_tasks),
                      prepare=lambda lock: prepare_output(cfg.out_dir, record, overwrite=cfg.overwrite,
                                                          writes=writes, folder_lock=lock)):
        return _precompute_claimed(cfg, dataset, dataset_sha256, reader, backbone, spec, device, jobs, mine, record)


def _precompute_claimed(cfg: FeatureConfig, dataset: DatasetManifest, dataset_sha256: str, reader: ShardReader,
                        backbone: Backbone, spec: TransformSpec, device: torch.device, jobs: list[ShardJob],
                        mine: list[ShardJob], record: dict[str, Any]) -> tuple[FeatureManifest | None, dict[str, Any]]:
    digest = record["config_hash"]
    todo = [job for job in mine if finished_shard(cfg.out_dir, job, cfg.storage, digest) is None]
    # This task owns these names (under its lock): temp files a killed run left of them can go.
    remove_stale_tmp(cfg.out_dir, {feature_path(cfg.out_dir, job, cfg.storage).name for job in todo})
    log.info("%s: %d of this task's %d shards to featurise (%d shards in all)", cfg.out_dir, len(todo), len(mine),
             len(jobs))
    augment = AugmentSpec(cfg.views, seed=cfg.seed) if cfg.augment else None
    stats = RunStats()
    if todo:
        extractor = FeatureExtractor(backbone, spec, device, record["config"]["amp"], cfg.dtype, cfg.batch_size)
        stats = _featurize(cfg, todo, reader, extractor, spec, augment, digest)
    manifest, missing = assemble_manifest(cfg.out_dir, record, dataset, dataset_sha256, jobs)
    if missing:
        log.info("features.json waits for %d shards from other tasks", len(missing))
    return manifest, _summary(cfg, stats, record, len(jobs), len(mine) - len(todo), manifest is not None)


def _summary(cfg: FeatureConfig, stats: RunStats, record: dict[str, Any], total: int, skipped: int,
             complete: bool) -> dict[str, Any]:
    wall = stats.wall_s
    return {
        "out": str(cfg.out_dir),
        "complete": complete,
        "config_hash": record["config_hash"],
        "features_dim": record["features_dim"],
        "shards_total": total,
        "shards_done": stats.shards_done,
        "shards_skipped": skipped,
        "images": stats.images,
        "seconds": round(wall, 3),
        "images_per_s": round(stats.images / wall, 1) if wall > 0 else None,
        "data_wait_share": round(stats.wait_s / wall, 3) if wall > 0 else None,
        "device": record["provenance"]["device"],
        "decode": record["config"]["decode"],
        "task_index": cfg.task_index,
        "num_tasks": cfg.num_tasks,
    }


def precompute_features(cfg: FeatureConfig) -> FeatureManifest | None:
    """The library entry point; returns the manifest, or None while other tasks' shards are still missing."""
    return run_precompute(cfg)[0]


def merge_features(out_dir: str | Path, storage_options: Any = None) -> FeatureManifest:
    """Write ``features.json`` once every task's shards exist (what the last array task does on its own).
    ``storage_options``: how to reach the dataset when the run read it from ``s3://``."""
    out_dir = Path(out_dir)
    if not (out_dir / STATE_DIR / CONFIG_RECORD).is_file():
        raise InputError("not a precompute-features folder (no .precompute/config.json)", path=str(out_dir))
    with claim_output(out_dir, STATE_DIR, what="precompute-features --merge", exclusive=True):
        # Read once the folder is ours: a task still running may yet rewrite it.
        record = read_config_record(out_dir)
        if record is None:
            raise InputError("not a precompute-features folder (no .precompute/config.json)", path=str(out_dir))
        return _merge_claimed(out_dir, record, storage_options)


def _merge_claimed(out_dir: Path, record: dict[str, Any], storage_options: Any = None) -> FeatureManifest:
    # Written by this tool into its own state folder: followed, with the caller's storage options.
    source = locate(record["dataset_dir"], storage_options=storage_options)
    dataset, dataset_sha256 = read_dataset_manifest(source)
    # Only the jobs' names and checksums: no shard is read, so adopted tars need no --source here.
    jobs = shard_jobs(dataset, source, tuple(record["splits"]))
    manifest, missing = assemble_manifest(out_dir, record, dataset, dataset_sha256, jobs)
    if manifest is None:
        raise ShardcacheError(f"{len(missing)} of {len(jobs)} feature shards are missing or outdated "
                              f"(first: {missing[0].shard.path}); run the remaining tasks first", path=str(out_dir))
    return manifest
