"""``pack_shards``: the Python call behind ``pack-shards`` (image sources), for notebooks and orchestrators.

Its keywords are the command's options, underscored (``--shard-samples`` is ``shard_samples``); the command
parses its options and calls this, so a pipeline run from Python packs exactly what the command packs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from preprocess.pack.append import append as append_files
from preprocess.pack.packer import PackConfig, pack
from preprocess.pack.parts import dataset_spec
from preprocess.pack.sources.members import DEFAULT_MAX_BYTES, SourceFields
from preprocess.staging import resolve_stage, run_staged
from shards.atomic import on_disk_full
from shards.errors import InputError
from shards.image.decode import DEFAULT_MAX_PIXELS
from shards.transport.location import locate

log = logging.getLogger("shardcache.pack")


def stage_root() -> str:
    """Where ``--out s3://...`` stages by default: ``$SHARDCACHE_STAGE_DIR`` or ``~/.cache/shardcache/stage``."""
    return os.environ.get("SHARDCACHE_STAGE_DIR") or str(Path.home() / ".cache" / "shardcache" / "stage")


def pack_shards(source: str | os.PathLike, out: str | os.PathLike, *, storage: str = "tar",
                shard_samples: int = 1000, max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.0, seed: int = 0,
                no_shuffle: bool = False, verify: str = "full", max_pixels: int = DEFAULT_MAX_PIXELS,
                resize_max_side: int | None = None, quality: int | None = None, strict: bool = False,
                allow_empty_classes: bool = False, workers: int | None = None, overwrite: bool = False,
                append: bool = False, prune: bool = False, source_fields: SourceFields | None = None,
                stage_dir: str | None = None, break_lease: bool = False, task_index: int = 0, num_tasks: int = 1,
                quiet: bool = False, s3: Any = None) -> dict[str, Any]:
    """Pack an image source (ImageFolder tree, CSV/JSONL list, Parquet, ``save_to_disk`` folder or WebDataset
    tars) into shards and ``dataset.json`` in ``out`` (a folder, or ``s3://`` staged locally then uploaded), as
    ``pack-shards SOURCE --out OUT`` does; returns the summary the command prints as JSON.

    ``append=True`` is ``--append`` (pack only files not yet in ``out``); ``workers=None`` is the shared default
    (``shards.cli.common.default_workers``), 0 or 1 packs in this process; ``s3`` is a
    ``shards.transport.s3.S3Options``. Bad input raises ``shards.errors.InputError`` naming the path."""
    from shards.cli.common import default_workers

    if prune and not append:
        raise InputError("--prune works only with --append")
    out, staged = str(out), None
    if locate(out).publishable:  # staged here, then uploaded (preprocess.staging)
        if append:
            raise InputError(f"--out {out}: --append works on local folders only; append locally, then upload")
        staged = resolve_stage(out, stage_dir, stage_root(), num_tasks=num_tasks, options=s3,
                               overwrite=overwrite, break_lease=break_lease)
    elif stage_dir is not None or break_lease:
        raise InputError(f"{'--stage-dir' if stage_dir is not None else '--break-lease'} works only with --out "
                         "s3://...")
    cfg = PackConfig(source=str(source), out=out if staged is None else str(staged.stage_dir), storage=storage,
                     max_samples=shard_samples, max_bytes=max_bytes, val_fraction=val_fraction, seed=seed,
                     shuffle=not no_shuffle, verify=verify, max_pixels=max_pixels, resize_max_side=resize_max_side,
                     quality=quality, strict=strict, allow_empty_classes=allow_empty_classes,
                     workers=max(1, default_workers() if workers is None else workers), task_index=task_index,
                     num_tasks=num_tasks, overwrite=overwrite, quiet=quiet,
                     source_fields=source_fields or SourceFields())
    if staged is not None:
        manifest, summary = run_staged(staged, lambda stage: _pack_result(pack(cfg)), dataset_spec())
    else:
        with on_disk_full(out):  # what a writer below raised as a bare OSError (a full disk: one line, exit 1)
            manifest, summary = _pack_result(append_files(cfg, prune=prune) if append else pack(cfg))
    if manifest is None:
        log.info("task %d/%d done; dataset.json appears when every task has finished", task_index, num_tasks)
    else:
        log.info("wrote %s/dataset.json", out)
    return summary


def _pack_result(result: Any) -> tuple:
    return result.manifest, result.summary
