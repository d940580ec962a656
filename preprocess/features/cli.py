"""The ``precompute-features`` console script: options -> ``FeatureConfig`` -> ``run_precompute``, one JSON line out."""

from __future__ import annotations

from pathlib import Path

import click

from shards.image.options import INTERPOLATIONS
from preprocess.features.featurize import AMP_MODES, DTYPES, FeatureConfig, merge_features, run_precompute
from preprocess.pack.cli import stage_root
from preprocess.staging import resolve_stage, run_staged
from preprocess.features.state import features_spec
from shards.atomic import on_disk_full
from shards.cli.common import cache_options, emit_json, handle_errors, quiet_option, s3_options, task_options
from shards.cli.sections import SectionedCommand
from shards.transport.location import locate
from shards.transport.s3 import S3Options
from shards.errors import InputError
from shards.formats.feature_names import FEATURE_SUFFIXES
from shards.stream.options import DECODES


def _triple(name: str, value: str | None) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        numbers = tuple(float(v) for v in value.split(","))
    except ValueError:
        numbers = ()
    if len(numbers) != 3:
        raise InputError(f"--{name} {value!r}: expected three comma-separated numbers, e.g. 0.485,0.456,0.406")
    return numbers


@click.command(cls=SectionedCommand, context_settings={"help_option_names": ["-h", "--help"]},
               sections={"Input": ("splits", "shard_source", "cache_dir", "cache_limit", "cache_eviction",
                                   "cache_prefetch", "cache_fallback", "cache_local"),
                         "Backbone": ("backbone", "weights", "seed", "dtype", "amp", "device"),
                         "Transform and views": ("resize", "crop", "mean", "std", "interpolation", "views",
                                                 "augment"),
                         "Output": ("out_dir", "storage", "overwrite", "merge_dir"),
                         "Loader": ("decode", "device_share", "batch_size", "workers"),
                         "Parallel jobs": ("task_index", "num_tasks"),
                         "Object storage": ("stage_dir", "break_lease", "s3_endpoint_url", "s3_profile",
                                            "s3_unsigned", "s3_max_concurrency", "s3_read_ahead",
                                            "min_transfer_rate", "request_deadline")})
@click.argument("data_dir", required=False, type=click.Path(path_type=str))
@click.option("--out", "-o", "out_dir", type=click.Path(path_type=str), help="Feature folder to write (FEAT_DIR).")
@click.option("--backbone", default="resnet50", show_default=True, help="torchvision classification model name.")
@click.option("--weights", help="'none' (random init from --seed), a local .pt/.pth/.safetensors state dict, or a "
                                "torchvision weights name (IMAGENET1K_V2) already in the torch hub cache. Required.")
@click.option("--seed", default=0, show_default=True, help="Seed of a random init and of augmented views.")
@click.option("--resize", type=int, help="Shorter side before the centre crop. Default: the weights' preset, or 256.")
@click.option("--crop", type=int, help="Centre crop size. Default: the weights' preset, or 224.")
@click.option("--mean", help="Normalisation mean, three comma-separated values. Default: the weights' preset.")
@click.option("--std", help="Normalisation std, three comma-separated values. Default: the weights' preset.")
@click.option("--interpolation", type=click.Choice(INTERPOLATIONS), help="Resize filter. Default: the preset's.")
@click.option("--views", default=0, show_default=True, help="Augmented views per image to store (with --augment).")
@click.option("--augment", is_flag=True, help="Store --views seeded RandomResizedCrop+flip views as 'views' [N,K,D].")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="float16", show_default=True)
@click.option("--format", "storage", type=click.Choice(sorted(FEATURE_SUFFIXES)), default="pt", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto (CUDA when present), cpu, cuda, cuda:1...")
@click.option("--amp", type=click.Choice([*AMP_MODES, "auto"]), default="auto", show_default=True,
              help="Autocast dtype; auto is bf16 on CUDA and off on CPU.")
@click.option("--decode", type=click.Choice(DECODES), default="fast", show_default=True,
              help="fast: DCT-scaled decode + one crop-then-resize in workers (default); standard: PIL + "
                   "torchvision ops, the exact reference; device: batched decode_jpeg + resize/crop on the model's "
                   "device.")
@click.option("--device-share", type=click.FloatRange(0.0, 1.0), default=1.0, show_default=True,
              help="With --decode device: the share of images decoded on the device; workers decode the rest with "
                   "the fast path, so both feed the model. Which images go where follows from their keys, so the "
                   "same share gives the same features (the share is part of the config).")
@click.option("--batch-size", default=64, show_default=True)
@click.option("--workers", default=2, show_default=True, help="DataLoader worker processes (decode + transform).")
@click.option("--split", "splits", multiple=True, help="Only these splits (repeatable). Default: all.")
@click.option("--source", "shard_source", default=None, metavar="PATH",
              help="Where the shards are when not beside dataset.json: the tars of an index made by shards index "
                   "(a folder, s3:// or https:// prefix).")
@click.option("--overwrite", is_flag=True, help="Replace a feature folder computed with a different config.")
@click.option("--merge", "merge_dir", type=click.Path(path_type=Path),
              help="Only write FEAT_DIR/features.json from finished parts (after a task array).")
@click.option("--stage-dir", type=click.Path(path_type=str), default=None,
              help="With --out s3://...: the local folder features are computed in before upload (default: "
                   "$SHARDCACHE_STAGE_DIR or ~/.cache/shardcache/stage, one folder per URL; required with "
                   "--num-tasks > 1, on a shared file system).")
@click.option("--break-lease", is_flag=True,
              help="With --out s3://...: take over the prefix's writer lease even while another run holds it "
                   "(a lease left by a killed run expires by itself 10 minutes after its last renewal).")
@task_options
@s3_options
@cache_options
@quiet_option
@handle_errors
def precompute_features_command(data_dir: str | None, out_dir: Path | None, backbone: str, weights: str | None,
                                seed: int, resize: int | None, crop: int | None, mean: str | None, std: str | None,
                                interpolation: str | None, views: int, augment: bool, dtype: str, storage: str,
                                device: str, amp: str, decode: str, device_share: float, batch_size: int,
                                workers: int,
                                splits: tuple[str, ...], shard_source: str | None, overwrite: bool,
                                merge_dir: Path | None,
                                stage_dir: str | None, break_lease: bool, task_index: int, num_tasks: int,
                                quiet: bool, s3: S3Options, cache) -> None:
    """Cache a frozen backbone's penultimate features of every image shard in DATA_DIR under --out.

    DATA_DIR and --out may be s3://bucket/prefix (the --s3-* options apply to both). An index made by shards index
    reads its tars from --source.

    One feature file per image shard, aligned sample for sample; features.json is written last, when all parts
    exist. Reruns skip finished shards; a different config refuses without --overwrite.
    """
    if merge_dir is not None:
        with on_disk_full(merge_dir):
            manifest = merge_features(merge_dir, storage_options=s3)
        emit_json({"out": str(merge_dir), "complete": True, "config_hash": manifest.config_hash,
                   "shards_total": sum(len(s.shards) for s in manifest.splits.values())})
        return
    missing = [name for name, value in (("DATA_DIR", data_dir), ("--out", out_dir), ("--weights", weights))
               if value is None]
    if missing:
        raise InputError(f"missing {', '.join(missing)} (see precompute-features --help)")
    staged = None
    if locate(out_dir).publishable:  # staged here, then uploaded (preprocess.staging)
        staged = resolve_stage(out_dir, stage_dir, stage_root(), num_tasks=num_tasks, options=s3,
                               overwrite=overwrite, break_lease=break_lease)
    elif stage_dir is not None or break_lease:
        raise InputError(f"{'--stage-dir' if stage_dir is not None else '--break-lease'} works only with --out "
                         "s3://...")
    cfg = FeatureConfig(
        data_dir=data_dir, out_dir=out_dir if staged is None else str(staged.stage_dir),
        backbone=backbone, weights=weights, seed=seed,
        resize=resize, crop=crop, mean=_triple("mean", mean), std=_triple("std", std), interpolation=interpolation,
        views=views, augment=augment, dtype=dtype, storage=storage, device=device, amp=amp, decode=decode,
        device_share=device_share, batch_size=batch_size, workers=workers, splits=tuple(splits) or None,
        task_index=task_index, num_tasks=num_tasks, overwrite=overwrite, quiet=quiet, storage_options=s3, cache=cache,
        shard_source=shard_source)
    if staged is not None:
        _, summary = run_staged(staged, lambda stage: run_precompute(cfg), features_spec())
    else:
        with on_disk_full(cfg.out_dir):  # what a writer below raised as a bare OSError (a full disk: one line, exit 1)
            _, summary = run_precompute(cfg)
    emit_json(summary)
