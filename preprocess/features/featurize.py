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

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from preprocess.features.backbones import Backbone, build_backbone
from preprocess.features.decode_share import resolve_auto
from preprocess.features.config import FeatureConfig, recorded
from preprocess.features.consumer import FeatureExtractor, RunStats, featurize_jobs
from preprocess.features.loader import ShardJob, ShardReader, shard_jobs
from preprocess.features.state import (CONFIG_RECORD, STATE_DIR, assemble_manifest, check_output, config_hash, feature_path,
                                      finished_shard, prepare_output, read_config_record)
from preprocess.features.transforms import AugmentSpec, transform_record
from shards.jobs.devices import resolve_device
from shards.image.options import DEFAULT_INTERPOLATION, IMAGENET_MEAN, IMAGENET_STD
from shards.image.transforms import TransformSpec
from shards.atomic import remove_stale_tmp
from shards.errors import InputError, ShardcacheError
from shards.loader.budget import MemoryBudget, read_ahead_within, resolve_budget
from shards.lock import claim_output
from shards.transport.location import locate
from shards.transport.manifest_io import read_dataset_manifest
from shards.transport.s3 import S3Options
from shards.transport.storage import get_storage
from shards.manifest import FEATURES_FILE, DatasetManifest, FeatureManifest
from shards.jobs.preemption import StopRequest, stop_signals

log = logging.getLogger(__name__)


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


def _run_record(cfg: FeatureConfig, backbone: Backbone, spec: TransformSpec, device: torch.device,
                splits: list[str]) -> dict[str, Any]:
    amp = ("bf16" if device.type == "cuda" else "off") if cfg.amp == "auto" else cfg.amp
    # The record names the decoder that made the pixels, not the option: on the device, nvjpeg's differ from libjpeg's.
    decoder = {"fast": "fast", "standard": "pil"}.get(cfg.decode, f"decode_jpeg:{device.type}")
    if cfg.decode in ("device", "auto") and device.type != "cpu":  # resized there by one roi_align per batch
        decoder += "+batch-crop"
    if cfg.device_share < 1.0:  # which images the device decodes is a function of the share: part of the numbers
        decoder += f"@{cfg.device_share:g}+fast"
    if cfg.decode == "auto":  # the share follows measured costs: the summary's decode_share keeps the shares taken
        decoder += "@auto+fast"
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
        "dataset_dir": recorded(cfg.source),
        "splits": splits,
        "features_dim": backbone.features_dim,
        "provenance": {"weights": backbone.weights, "device": str(device), "batch_size": cfg.batch_size,
                       "workers": cfg.workers, "num_tasks": cfg.num_tasks,
                       **({} if cfg.shards_at is None else {"source": recorded(cfg.shards_at)})},
    }


def run_precompute(cfg: FeatureConfig,
                   stop: StopRequest | None = None) -> tuple[FeatureManifest | None, dict[str, Any]]:
    """Featurise this task's unfinished shards; write ``features.json`` if every shard is then done.

    The run's entry: unless the caller passes its own ``stop``, SIGTERM, SIGINT and SIGUSR1 are caught while it runs
    (``shards.jobs.preemption``), so a stopped task keeps its finished shards and raises ``Preempted``."""
    if stop is None:
        with stop_signals("precompute-features") as caught:
            return run_precompute(cfg, caught)
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
    cfg = resolve_auto(cfg, device)  # --decode auto: which side decodes, now the device is known
    jobs = shard_jobs(dataset, cfg.source, cfg.splits, cfg.shards_at)
    mine = [job for job in jobs if job.index % cfg.num_tasks == cfg.task_index]
    memory = resolve_budget(cfg.memory_budget)
    reader = ShardReader(dataset.storage, len(dataset.classes), budgeted_options(cfg, memory), cfg.cache,
                         cfg.source.text, memory=memory)
    reader.check_locations(mine)
    record = _run_record(cfg, backbone, spec, device, sorted({job.split for job in jobs}))
    # Every file of the finished folder, whichever task writes it: what --overwrite may not write over unless the
    # old output names it.
    writes = {feature_path(cfg.out_dir, job, cfg.storage).name for job in jobs} | {FEATURES_FILE}
    check_output(cfg.out_dir, record, overwrite=cfg.overwrite, writes=writes)  # refuse before even a lock file
    with claim_output(cfg.out_dir, STATE_DIR, what="precompute-features", task=(cfg.task_index, cfg.num_tasks),
                      prepare=lambda lock: prepare_output(cfg.out_dir, record, overwrite=cfg.overwrite,
                                                          writes=writes, folder_lock=lock)):
        return _precompute_claimed(cfg, dataset, dataset_sha256, reader, backbone, spec, device, jobs, mine, record,
                                   stop)


def _precompute_claimed(cfg: FeatureConfig, dataset: DatasetManifest, dataset_sha256: str, reader: ShardReader,
                        backbone: Backbone, spec: TransformSpec, device: torch.device, jobs: list[ShardJob],
                        mine: list[ShardJob], record: dict[str, Any],
                        stop: StopRequest) -> tuple[FeatureManifest | None, dict[str, Any]]:
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
        stats = featurize_jobs(cfg, todo, reader, extractor, spec, augment, digest, stop)
    manifest, missing = assemble_manifest(cfg.out_dir, record, dataset, dataset_sha256, jobs)
    if missing:
        log.info("features.json waits for %d shards from other tasks", len(missing))
    summary = _summary(cfg, stats, record, len(jobs), len(mine) - len(todo), manifest is not None)
    options = reader.storage_options
    summary["memory_budget"] = reader.memory.record(
        read_ahead_bytes_per_process=options.read_ahead_bytes if isinstance(options, S3Options) else None)
    return manifest, summary


def budgeted_options(cfg: FeatureConfig, memory: MemoryBudget) -> Any:
    """``cfg.storage_options`` with each worker's S3 read-ahead within the loader's budget (it is fixed before
    the loader exists: ``shards.loader.budget.read_ahead_within``)."""
    options = cfg.storage_options
    if not isinstance(options, S3Options):
        return options
    ahead = read_ahead_within(memory, max(1, cfg.workers), options.read_ahead_bytes)
    return dataclasses.replace(options, read_ahead_bytes=ahead)


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
        "stages": {name: round(seconds, 4) for name, seconds in stats.stages.items()},
        **stats.extra,
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
