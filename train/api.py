"""``train_from_shards``: the Python call behind ``train-from-shards``, for notebooks and orchestrators.

Its keywords are the command's options, underscored (``--out`` is ``out``, ``--max-samples`` ``max_samples``,
``--no-report`` ``no_report``); the command parses its options and builds its ``TrainConfig`` with
``train_config``, so a run started from Python is configured exactly as the command's. torch is imported when a
run starts, not when this module is.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from shards.errors import InputError
from shards.transport.location import locate
from train.config import TrainConfig
from train.options import (DEFAULT_DECODE, CacheOptions, DataOptions, LoaderOptions, ModelOptions, OptimOptions,
                           RunOptions)


def train_from_shards(path: str | os.PathLike | None = None, **options: Any) -> dict[str, Any]:
    """Train as ``train-from-shards PATH --out OUT ...`` does (``options``: ``train_config``'s keywords, ``out``
    required) and return the summary the command prints as JSON (val_top1, data_wait_share, run_dir...).

    Example: ``train_from_shards("photos-feat", out="runs/probe", head="linear", epochs=20, lr=0.01)``."""
    from train.run.loop import train

    return train(train_config(path, **options))


def train_config(path: str | os.PathLike | None = None, *, out: str | os.PathLike, data: Sequence[str] = (),
                 class_map: str = "same", epoch_size: int | None = None, classes: str | Sequence[str] | None = None,
                 keys: str | None = None, where: str | None = None, max_samples: int | None = None,
                 source: str | None = None, exclude_keys: str | None = None, record_keys: bool = False,
                 task: str = "auto", loss: str = "mse", head: str = "linear", standardize: bool | None = None,
                 logreg_c: float | None = None, hidden_dim: int = 512, dropout: float = 0.0, model: str = "resnet18",
                 weights: str | None = None, image_size: int = 224, decode: str = DEFAULT_DECODE,
                 fast_decode: bool = False, epochs: int = 10, batch_size: int = 256, optimizer: str = "sgd",
                 lr: float | None = None, momentum: float = 0.9, warmup_epochs: float = 0.0,
                 weight_decay: float = 1e-4, label_smoothing: float = 0.0, class_weighted_loss: bool = False,
                 balanced_sampler: bool = False, seed: int = 0, workers: int | str | None = None,
                 run_mode: str | None = None, worker_threads: int = 1, prefetch: int = 2, feature_window: int = 0,
                 stall_timeout: float = 600.0, resume_audit: str = "refuse", memory_budget: int | None = None,
                 amp: bool = False, device: str = "auto",
                 train_split: str = "train", val_split: str = "val", checkpoint_every: int = 0,
                 resume: bool = False, dry_run: bool = False, overwrite: bool = False, no_report: bool = False,
                 cache_images: bool = False, memory_limit: int | None = None, stop_after_steps: int | None = None,
                 quiet: bool = False, s3: Any = None, cache: Any = None) -> TrainConfig:
    """The ``TrainConfig`` of ``train-from-shards`` with these options (see its ``--help``): PATH and ``data``
    (``--data PATH[:WEIGHT]`` values) are the sources; ``classes`` is ``"a,b"`` or a list; ``workers`` a count
    or ``"auto"``; ``s3`` a ``shards.transport.s3.S3Options``; ``cache`` a ``shards.cache.node.ShardCache``."""
    sources = data_sources(None if path is None else str(path), tuple(data))
    if isinstance(classes, str):
        classes = [name.strip() for name in classes.split(",") if name.strip()]
    subset = {"classes": None if classes is None else list(classes),
              "keys": os.path.abspath(keys) if keys else None, "where": where, "max_samples": max_samples}
    remote = any(locate(p).uses_storage_options for p in [s["path"] for s in sources] + [source or ""])
    return TrainConfig(
        data=DataOptions(sources[0]["path"], sources=sources if len(sources) > 1 or len(sources[0]) > 1 else [],
                         class_map=class_map, subset=subset if any(v is not None for v in subset.values()) else None,
                         epoch_size=epoch_size, train_split=train_split, val_split=val_split,
                         exclude_keys=os.path.abspath(exclude_keys) if exclude_keys else None,
                         source=(os.path.abspath(source) if source and locate(source).local_path() is not None
                                 else source)),
        model=ModelOptions(task=task, head=head, standardize=standardize, logreg_c=logreg_c, hidden_dim=hidden_dim,
                           dropout=dropout, name=model, weights=weights),
        optim=OptimOptions(epochs=epochs, batch_size=batch_size, optimizer=optimizer, lr=lr, momentum=momentum,
                           warmup_epochs=warmup_epochs, weight_decay=weight_decay, loss=loss,
                           label_smoothing=label_smoothing, class_weighted_loss=class_weighted_loss,
                           balanced_sampler=balanced_sampler, seed=seed, amp=amp),
        loader=LoaderOptions(image_size=image_size, decode=decode, fast_decode=fast_decode,
                             workers=None if workers == "auto" else workers,
                             run_mode=run_mode or ("auto" if workers == "auto" else "processes"),
                             worker_threads=worker_threads, prefetch=prefetch, feature_window=feature_window,
                             stall_timeout=stall_timeout, resume_audit=resume_audit, memory_budget=memory_budget),
        cache=cache_group(s3.to_dict() if remote and s3 is not None else None, cache, images=cache_images,
                          memory_limit=memory_limit),
        run=RunOptions(str(out), device=device, checkpoint_every=checkpoint_every, resume=resume,
                       overwrite=overwrite, dry_run=dry_run, quiet=quiet, stop_after_steps=stop_after_steps,
                       report=not no_report, record_keys=record_keys))


def cache_group(storage_options: dict | None, cache: Any, *, images: bool, memory_limit: int | None) -> CacheOptions:
    """The cache group from the shared ``--cache-*`` options (``cache`` is None without ``--cache-dir``)."""
    if cache is None:
        return CacheOptions(storage_options, images=images, memory_limit=memory_limit)
    return CacheOptions(storage_options, dir=os.path.abspath(cache.dir), limit=cache.limit, fallback=cache.fallback,
                        eviction=cache.eviction, prefetch_bytes=cache.prefetch_bytes, local=bool(cache.local),
                        images=images, memory_limit=memory_limit)


def data_sources(path: str | None, data_options: tuple[str, ...]) -> list[dict]:
    """The sources from PATH and the ``--data PATH[:WEIGHT]`` values; PATH, when given, is the first source."""
    from shards.select.mixture import SourceSpec

    specs = [SourceSpec.parse(v) for v in data_options]
    if path is not None:
        specs.insert(0, SourceSpec(path))
    if not specs:
        raise InputError("give a PATH or at least one --data PATH[:WEIGHT]")
    sources = []
    for spec in specs:
        row = {"path": locate(spec.path).record()}  # a local path made absolute, a URL as it is
        row.update({k: getattr(spec, k) for k in ("weight", "repeat", "choose") if getattr(spec, k) is not None})
        sources.append(row)
    return sources
