"""The ``precompute-features`` console script: options -> ``FeatureConfig`` -> ``run_precompute``, one JSON line out.

torch and torchvision are imported inside the command body only, so ``--help`` and option errors come back at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from shards.image.options import INTERPOLATIONS
from preprocess.features.vocabulary import AMP_NAMES, DTYPE_NAMES
from preprocess.features.api import precompute_features
from shards.atomic import on_disk_full
from shards.cli.common import (S3_OPTION_NAMES, cache_options, device_option, emit_json, handle_errors,
                               memory_budget_option, overwrite_option, quiet_option, s3_options, seed_option,
                               shard_source_option, staging_options, task_options, version_option, workers_option)
from shards.cli.sections import SectionedCommand
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


class DecodeCheckEvery(click.ParamType):
    """``--decode-check``: check 1 in N device-decoded images (an integer N >= 1), or none (``0`` or ``off``).
    One spelling, the count, as ``FeatureConfig.decode_check`` records it."""

    name = "N|off"

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return self.name  # as written, not upper-cased

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            every = value
        elif str(value).strip().lower() == "off":
            return 0
        else:
            try:
                every = int(str(value).strip())
            except ValueError:
                self.fail(f"{value!r}: expected a whole number N (1 in N images checked) or off", param, ctx)
        if every < 0:
            self.fail(f"{value!r}: expected N >= 1 (1 in N images checked), or 0 / off for no check", param, ctx)
        return every


@click.command(cls=SectionedCommand, context_settings={"help_option_names": ["-h", "--help"]},
               sections={"Input": ("splits", "shard_source", "cache_dir", "cache_limit", "cache_eviction",
                                   "cache_prefetch", "cache_fallback", "cache_local"),
                         "Backbone": ("backbone", "weights", "seed", "dtype", "amp", "device"),
                         "Transform and views": ("resize", "crop", "mean", "std", "interpolation", "views",
                                                 "augment"),
                         "Output": ("out_dir", "storage", "overwrite", "merge_dir"),
                         "Loader": ("decode", "device_share", "decode_check", "batch_size", "workers", "memory_budget"),
                         "Parallel jobs": ("task_index", "num_tasks"),
                         "Object storage": ("stage_dir", "break_lease", *S3_OPTION_NAMES)},
               common=("out_dir", "backbone", "weights", "device", "batch_size", "workers", "dtype", "quiet"),
               examples=("precompute-features photos-shards --out photos-feat --backbone resnet50 "
                         "--weights IMAGENET1K_V2",
                         "precompute-features photos-shards --out photos-feat --backbone resnet50 "
                         "--weights resnet50.safetensors --device cuda:1 --dtype float32"))
@click.argument("data_dir", required=False, type=click.Path(path_type=str))
@click.option("--out", "-o", "out_dir", type=click.Path(path_type=str), help="Feature folder to write (FEAT_DIR).")
@click.option("--backbone", default="resnet50", show_default=True, help="torchvision classification model name.")
@click.option("--weights", help="'none' (random init from --seed), a local .pt/.pth/.safetensors state dict, or a "
                                "torchvision weights name (IMAGENET1K_V2) already in the torch hub cache. Required.")
@seed_option("a random init and of augmented views")
@click.option("--resize", type=int, help="Shorter side before the centre crop. Default: the weights' preset, or 256.")
@click.option("--crop", type=int, help="Centre crop size. Default: the weights' preset, or 224.")
@click.option("--mean", help="Normalisation mean, three comma-separated values. Default: the weights' preset.")
@click.option("--std", help="Normalisation std, three comma-separated values. Default: the weights' preset.")
@click.option("--interpolation", type=click.Choice(INTERPOLATIONS), help="Resize filter. Default: the preset's.")
@click.option("--views", default=0, show_default=True, help="Augmented views per image to store (with --augment).")
@click.option("--augment", is_flag=True, help="Store --views seeded RandomResizedCrop+flip views as 'views' [N,K,D].")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="float16", show_default=True)
@click.option("--format", "storage", type=click.Choice(sorted(FEATURE_SUFFIXES)), default="pt", show_default=True)
@device_option()
@click.option("--amp", type=click.Choice([*AMP_NAMES, "auto"]), default="auto", show_default=True,
              help="Autocast dtype; auto is bf16 on CUDA and off on CPU.")
@click.option("--decode", type=click.Choice(DECODES), default="fast", show_default=True,
              help="fast: DCT-scaled decode + one crop-then-resize in workers (default); standard: PIL + "
                   "torchvision ops, the exact reference; device: batched decode_jpeg + resize/crop on the model's "
                   "device; auto: the device and the workers split the decoding by measured costs, re-measured as "
                   "the run goes (p99-aware); without an accelerator, the workers' fast path.")
@click.option("--device-share", type=click.FloatRange(0.0, 1.0), default=1.0, show_default=True,
              help="With --decode device: the share of images decoded on the device; workers decode the rest with "
                   "the fast path, so both feed the model. Which images go where follows from their keys, so the "
                   "same share gives the same features (the share is part of the config).")
@click.option("--decode-check", type=DecodeCheckEvery(), default=256, show_default=True,
              help="With --decode device: decode 1 in N images again on the CPU (chosen by key and --seed) and "
                   "compare; a difference over 2 grey levels turns device decoding off for the rest of the run and "
                   "is kept in the summary. 0 or off: no check.")
@click.option("--batch-size", default=64, show_default=True)
@workers_option("DataLoader worker processes (decode + transform)")
@click.option("--split", "splits", multiple=True, help="Only these splits (repeatable). Default: all.")
@shard_source_option(name="shard_source")
@overwrite_option("a feature folder computed with a different config")
@click.option("--merge", "merge_dir", type=click.Path(path_type=Path),
              help="Only write FEAT_DIR/features.json from finished parts (after a task array).")
@staging_options("features are computed in")
@memory_budget_option
@task_options
@s3_options
@cache_options
@quiet_option
@version_option
@handle_errors
def precompute_features_command(data_dir: str | None, out_dir: Path | None, backbone: str, weights: str | None,
                                seed: int, resize: int | None, crop: int | None, mean: str | None, std: str | None,
                                interpolation: str | None, views: int, augment: bool, dtype: str, storage: str,
                                device: str, amp: str, decode: str, device_share: float, decode_check: int,
                                batch_size: int,
                                workers: int, memory_budget: int | None,
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
    from preprocess.features.featurize import merge_features

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
    emit_json(precompute_features(
        data_dir, out_dir, weights=weights, backbone=backbone, device=device, batch_size=batch_size, workers=workers,
        dtype=dtype, stage_dir=stage_dir, break_lease=break_lease, seed=seed, resize=resize, crop=crop,
        mean=_triple("mean", mean), std=_triple("std", std), interpolation=interpolation, views=views,
        augment=augment, storage=storage, amp=amp, decode=decode, device_share=device_share,
        decode_check=decode_check,
        splits=tuple(splits) or None, task_index=task_index, num_tasks=num_tasks, overwrite=overwrite, quiet=quiet,
        storage_options=s3, cache=cache, shard_source=shard_source, memory_budget=memory_budget))
