"""``precompute-features``: a frozen backbone's penultimate features, one feature file per image shard.

The config hash covers what changes the numbers: backbone, weights sha256 (or the init seed of a random init),
transform, augmentation and views, output dtype, the resolved AMP mode, the resolved decoder (``pil``,
``decode_jpeg:cpu`` or ``decode_jpeg:cuda``: nvjpeg's pixels differ slightly from libjpeg's) and the file format.
Device, batch size and worker count are not in it (they change speed, not features beyond float noise) and are
recorded as provenance instead. The dataset may be an ``s3://bucket/prefix`` (read with
``storage_options``): ``dataset_dir`` then records the URL, ``dataset_sha256`` is the sha256 of the remote
``dataset.json`` bytes. Resume state and the assembly of ``features.json`` live in
``preprocess.features.state``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from preprocess.features.backbones import Backbone, build_backbone
from preprocess.features.loader import ShardBatches, ShardJob, make_loader, shard_jobs
from preprocess.features.state import (STATE_DIR, assemble_manifest, check_output, config_hash, feature_path,
                                      finished_shard, prepare_output, read_config_record, write_shard_record)
from preprocess.features.transforms import AugmentSpec, FeatureTransform, eval_tensors, views_tensors
from shards.devices import resolve_device
from shards.image.device import Normalize, decode_images
from shards.image.options import DEFAULT_INTERPOLATION, IMAGENET_MEAN, IMAGENET_STD
from shards.atomic import check_local_output, remove_stale_tmp
from shards.errors import CorruptDataError, InputError, MissingInputError, ShardcacheError
from shards.lock import claim_output
from shards.stream.options import DECODES
from shards.formats.features import FEATURE_SUFFIXES, FeatureShard, write_feature_shard
from shards.formats.s3 import is_s3
from shards.check.freshness import read_s3_dataset
from shards.manifest import (FEATURES_FILE, DatasetManifest, FeatureManifest, ShardInfo, dataset_manifest_sha256,
                             load_dataset_manifest)
from shards.progress import progress

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "float32": torch.float32}
AMP_MODES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


@dataclass(frozen=True)
class FeatureConfig:
    """Everything one ``precompute-features`` task needs; transform fields left None come from the weights."""

    data_dir: Path | str  # a local folder, or an s3://bucket/prefix (kept as a str, without a trailing /)
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
    batch_size: int = 64
    workers: int = 2
    splits: tuple[str, ...] | None = None
    task_index: int = 0
    num_tasks: int = 1
    overwrite: bool = False
    quiet: bool = False
    storage_options: Any = None  # S3Options (or a mapping of its fields) for an s3:// data_dir
    cache: Any = None  # a shards.cache.node.ShardCache: keep fetched image shards on this node's disk

    def __post_init__(self) -> None:
        check_local_output(self.out_dir)  # before Path(), which turns s3://b/x into s3:/b/x
        if is_s3(self.data_dir):
            from shards.formats.s3 import S3Options, parse_s3_url

            url = str(self.data_dir).rstrip("/")
            parse_s3_url(url)
            object.__setattr__(self, "data_dir", url)
            object.__setattr__(self, "storage_options", S3Options.from_mapping(self.storage_options))
        else:
            object.__setattr__(self, "data_dir", Path(self.data_dir))
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
        if self.num_tasks < 1 or not 0 <= self.task_index < self.num_tasks:
            raise InputError(f"task index {self.task_index} is not in [0, {self.num_tasks})")
        if not is_s3(self.data_dir) and self.data_dir.resolve() == self.out_dir.resolve():
            raise InputError("--out must differ from the dataset folder", path=str(self.out_dir))


@dataclass
class RunStats:
    images: int = 0
    shards_done: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_transform(cfg: FeatureConfig, backbone: Backbone) -> FeatureTransform:
    """Options override the weights' own eval preset, which overrides the ImageNet default (resize 256, crop 224)."""
    base = dict(backbone.eval_preset or {"resize": 256, "crop": 224, "mean": IMAGENET_MEAN, "std": IMAGENET_STD,
                                         "interpolation": DEFAULT_INTERPOLATION})
    if cfg.crop is not None and cfg.resize is None:  # keep the preset's resize/crop ratio
        base["resize"] = round(cfg.crop * base["resize"] / base["crop"])
    for name in ("resize", "crop", "mean", "std", "interpolation"):
        if getattr(cfg, name) is not None:
            base[name] = getattr(cfg, name)
    spec = FeatureTransform(int(base["resize"]), int(base["crop"]), tuple(base["mean"]), tuple(base["std"]),
                            str(base["interpolation"]))
    if backbone.input_size is not None and spec.crop != backbone.input_size:
        raise InputError(f"{backbone.name} takes {backbone.input_size}px inputs only; --crop is {spec.crop}")
    return spec


def _run_record(cfg: FeatureConfig, backbone: Backbone, spec: FeatureTransform, device: torch.device,
                splits: list[str]) -> dict[str, Any]:
    amp = ("bf16" if device.type == "cuda" else "off") if cfg.amp == "auto" else cfg.amp
    # The recorded names predate the decode modes' names and stay: renaming them would change every cache's hash.
    decoder = {"fast": "fast", "standard": "pil"}.get(cfg.decode, f"decode_jpeg:{device.type}")
    augment = AugmentSpec(cfg.views, seed=cfg.seed) if cfg.augment else None
    config = {
        "backbone": backbone.name,
        "weights_sha256": backbone.weights_sha256,
        "init_seed": backbone.init_seed,
        "transform": spec.to_dict(),
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
        "dataset_dir": cfg.data_dir if is_s3(cfg.data_dir) else str(cfg.data_dir.resolve()),
        "splits": splits,
        "features_dim": backbone.features_dim,
        "provenance": {"weights": backbone.weights, "device": str(device), "batch_size": cfg.batch_size,
                       "workers": cfg.workers, "num_tasks": cfg.num_tasks},
    }


class FeatureExtractor:
    """uint8 batches on the device -> penultimate features on the CPU, in the output dtype."""

    def __init__(self, backbone: Backbone, spec: FeatureTransform, device: torch.device, amp: str, dtype: str,
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


def _device_inputs(batch: dict[str, Any], job: ShardJob, spec: FeatureTransform, augment: AugmentSpec | None,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The batch's uint8 model inputs on the device; with ``--decode device`` they are decoded and cropped there."""
    if "datas" not in batch:
        views = batch.get("views")
        return batch["images"].to(device, non_blocking=True), (None if views is None else
                                                               views.to(device, non_blocking=True))
    crop = spec.crop
    if not batch["keys"]:
        empty = torch.empty(0, 3, crop, crop, dtype=torch.uint8, device=device)
        no_views = None if augment is None else torch.empty(0, augment.views, 3, crop, crop, dtype=torch.uint8)
        return empty, no_views
    try:
        decoded = decode_images(batch["datas"], batch["exts"], batch["orientations"], device, keys=batch["keys"])
    except CorruptDataError as exc:
        raise CorruptDataError(exc.reason, path=job.path, key=exc.key) from exc
    views = None if augment is None else views_tensors(decoded, batch["keys"], spec, augment)
    return eval_tensors(decoded, spec), views


def _write_job(cfg: FeatureConfig, job: ShardJob, parts: list[tuple], digest: str) -> None:
    keys = [k for part in parts for k in part[2]]
    if len(keys) != job.samples:
        raise CorruptDataError(f"holds {len(keys)} samples but dataset.json says {job.samples}", path=job.path)
    views = [p[3] for p in parts]
    shard = FeatureShard(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), keys,
                         torch.cat(views) if cfg.views else None)
    path = feature_path(cfg.out_dir, job, cfg.storage)
    size, sha256 = write_feature_shard(path, shard, cfg.storage)
    info = ShardInfo(path.name, len(keys), size, sha256, source=job.name, source_sha256=job.sha256)
    write_shard_record(cfg.out_dir, job, cfg.storage, info, digest)


def _featurize(cfg: FeatureConfig, jobs: list[ShardJob], storage: str, extractor: FeatureExtractor,
               spec: FeatureTransform, augment: AugmentSpec | None, digest: str) -> RunStats:
    stats = RunStats()
    dataset = ShardBatches(jobs, storage, batch_size=cfg.batch_size, spec=spec, augment=augment, decode=cfg.decode,
                           storage_options=cfg.storage_options, shard_cache=_shard_cache(cfg))
    loader = make_loader(dataset, workers=cfg.workers, pin_memory=extractor.device.type == "cuda")
    by_index = {job.index: job for job in jobs}
    parts: dict[int, list[tuple]] = {job.index: [] for job in jobs}
    bar = progress(total=sum(j.samples for j in jobs), desc="features", unit="img", quiet=cfg.quiet)
    start = time.perf_counter()
    batches = iter(loader)
    with bar:
        while True:
            waited = time.perf_counter()
            batch = next(batches, None)
            stats.wait_s += time.perf_counter() - waited
            if batch is None:
                break
            job = by_index[batch["job"]]
            if batch.get("input_error"):
                raise InputError(batch["error"], path=batch["input_error"])
            if "error" in batch:
                raise CorruptDataError(f"cannot read or decode ({batch['error']})", path=job.path, key=batch["key"])
            images, views = _device_inputs(batch, job, spec, augment, extractor.device)
            features = extractor(images)
            view_features = None
            if views is not None:
                view_features = extractor(views.flatten(0, 1)).view(len(features), cfg.views, extractor.dim)
            parts[job.index].append((features, batch["labels"], batch["keys"], view_features))
            bar.update(len(batch["keys"]))
            stats.images += len(batch["keys"])
            if batch["last"]:
                _write_job(cfg, job, parts.pop(job.index), digest)
                stats.shards_done += 1
    stats.wall_s = time.perf_counter() - start
    return stats


def run_precompute(cfg: FeatureConfig) -> tuple[FeatureManifest | None, dict[str, Any]]:
    """Featurise this task's unfinished shards; write ``features.json`` if every shard is then done."""
    dataset, dataset_sha256 = load_source_dataset(cfg.data_dir, cfg.storage_options)
    unknown = sorted(set(cfg.splits or ()) - set(dataset.splits))
    if unknown:
        raise InputError(f"no split(s) {unknown} in dataset.json (it has {sorted(dataset.splits)})",
                         path=str(cfg.data_dir))
    backbone = build_backbone(cfg.backbone, cfg.weights, seed=cfg.seed)
    spec = resolve_transform(cfg, backbone)
    device = resolve_device(cfg.device)
    jobs = shard_jobs(dataset, cfg.data_dir, cfg.splits)
    mine = [job for job in jobs if job.index % cfg.num_tasks == cfg.task_index]
    for job in mine:
        if not is_s3(job.path) and not Path(job.path).is_file():  # on S3 a missing object is a 404 when read
            raise MissingInputError("image shard listed in dataset.json is missing", path=job.path)
    record = _run_record(cfg, backbone, spec, device, sorted({job.split for job in jobs}))
    # Every file of the finished folder, whichever task writes it: what --overwrite may not write over unless the
    # old output names it.
    writes = {feature_path(cfg.out_dir, job, cfg.storage).name for job in jobs} | {FEATURES_FILE}
    check_output(cfg.out_dir, record, overwrite=cfg.overwrite, writes=writes)  # refuse before even a lock file
    with claim_output(cfg.out_dir, STATE_DIR, what="precompute-features", task=(cfg.task_index, cfg.num_tasks),
                      prepare=lambda lock: prepare_output(cfg.out_dir, record, overwrite=cfg.overwrite,
                                                          writes=writes, folder_lock=lock)):
        return _precompute_claimed(cfg, dataset, backbone, spec, device, jobs, mine, record, dataset_sha256)


def load_source_dataset(data_dir: Path | str, storage_options: Any = None) -> tuple[DatasetManifest, str | None]:
    """The image dataset's manifest and, for ``s3://``, the sha256 of the very bytes it was parsed from (a local
    folder's is taken when ``features.json`` is assembled, as before: None here)."""
    if is_s3(data_dir):
        return read_s3_dataset(str(data_dir), storage_options)
    return load_dataset_manifest(data_dir), None


def _precompute_claimed(cfg: FeatureConfig, dataset: DatasetManifest, backbone: Backbone, spec: FeatureTransform,
                        device: torch.device, jobs: list[ShardJob], mine: list[ShardJob],
                        record: dict[str, Any], dataset_sha256: str | None = None
                        ) -> tuple[FeatureManifest | None, dict[str, Any]]:
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
        stats = _featurize(cfg, todo, dataset.storage, extractor, spec, augment, digest)
    if dataset_sha256 is None:
        dataset_sha256 = dataset_manifest_sha256(cfg.data_dir)
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
    record = read_config_record(out_dir)
    if record is None:
        raise InputError("not a precompute-features folder (no .precompute/config.json)", path=str(out_dir))
    with claim_output(out_dir, STATE_DIR, what="precompute-features --merge", exclusive=True):
        return _merge_claimed(out_dir, record, storage_options)


def _merge_claimed(out_dir: Path, record: dict[str, Any], storage_options: Any = None) -> FeatureManifest:
    recorded = record["dataset_dir"]  # written by this tool into its own state folder
    dataset_dir = recorded if is_s3(recorded) else Path(recorded)
    dataset, dataset_sha256 = load_source_dataset(dataset_dir, storage_options)
    jobs = shard_jobs(dataset, dataset_dir, tuple(record["splits"]))
    if dataset_sha256 is None:
        dataset_sha256 = dataset_manifest_sha256(dataset_dir)
    manifest, missing = assemble_manifest(out_dir, record, dataset, dataset_sha256, jobs)
    if manifest is None:
        raise ShardcacheError(f"{len(missing)} of {len(jobs)} feature shards are missing or outdated "
                              f"(first: {missing[0].name}); run the remaining tasks first", path=str(out_dir))
    return manifest


def _shard_cache(cfg: FeatureConfig) -> Any:
    """The node-local shard cache for the image shards read, or None (see ``shards.cache.cached_shards``)."""
    if cfg.cache is None:
        return None
    from shards.cache.cached_shards import CachedShards

    return CachedShards(cfg.cache, cfg.storage_options)
