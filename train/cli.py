"""The ``train-from-shards`` console script: options -> ``TrainConfig`` -> ``train(cfg)`` -> one JSON line.

The ``--help`` sections are ``TrainConfig``'s option groups (``train.options``), so an option's section says where
``config.json`` records it; Run is the rest (``run.*``), and Cache and storage also lists the S3 options that make
``cache.storage_options``. The most used options of every group print first, under Most used."""

from __future__ import annotations

import os
import time
from typing import Any

import click

from shards.cli.common import (S3_OPTION_NAMES, WORKERS_RULE, ByteSize, cache_options, class_names, device_option,
                               emit_json, handle_errors, memory_budget_option, overwrite_option, quiet_option,
                               s3_options, seed_option, shard_source_option, version_option)
from shards.cli.sections import SectionedCommand
from shards.jobs.preemption import stop_signals
from shards.stream.options import STREAM_DECODES
from train.api import train_config
from train.options import CLASS_MAPS, DEFAULT_DECODE, HEADS, LOSSES, OPTIMIZERS, RESUME_AUDITS, RUN_MODES, TASKS


class WorkerCount(click.ParamType):
    """``--workers``: a count (an integer >= 0) or ``auto``."""

    name = "N|auto"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | str:
        if value == "auto" or (type(value) is int and value >= 0):
            return value
        try:
            count = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is neither a worker count nor 'auto'", param, ctx)
        if count < 0:
            self.fail(f"{count} is not a worker count (>= 0)", param, ctx)
        return count


@click.command(cls=SectionedCommand, context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
               sections={"Data": ("data_options", "class_map", "epoch_size", "subset_classes", "subset_keys",
                                  "subset_where", "subset_max", "exclude_keys", "train_split", "val_split", "source"),
                         "Model": ("task", "head", "standardize", "logreg_c", "hidden_dim", "dropout", "model",
                                   "weights"),
                         "Optimisation": ("epochs", "batch_size", "optimizer", "lr", "momentum", "warmup_epochs",
                                          "weight_decay", "loss", "label_smoothing", "class_weighted_loss",
                                          "balanced_sampler", "seed", "amp"),
                         "Loader": ("image_size", "decode", "fast_decode", "workers", "run_mode", "worker_threads",
                                    "prefetch", "feature_window", "stall_timeout", "resume_audit", "memory_budget"),
                         "Cache and storage": ("cache_images", "memory_limit", "cache_dir", "cache_limit",
                                               "cache_eviction", "cache_prefetch", "cache_fallback", "cache_local",
                                               *S3_OPTION_NAMES)},
               common=("out_dir", "epochs", "batch_size", "lr", "model", "head", "device", "workers", "resume",
                       "dry_run"),
               examples=("train-from-shards photos-shards --out runs/r18 --model resnet18 --epochs 30",
                         "train-from-shards photos-feat --out runs/probe --head linear --epochs 20 --lr 0.01"))
@click.argument("path", type=click.Path(file_okay=False), required=False)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Run folder, local (copy it elsewhere afterwards): config.json, metrics.jsonl, curves.png, "
                   "last.pt, best.pt, model.pt.")
@click.option("--data", "data_options", multiple=True, metavar="PATH[:WEIGHT]",
              help="A source to mix (repeat the option): PATH, PATH:WEIGHT (a share of each epoch), PATH:repeat=R "
                   "or PATH:choose=N; sources draw whole shard runs from the seed.")
@click.option("--class-map", type=click.Choice(CLASS_MAPS), default="same",
              help="Sources with different class lists: union maps labels by class name (recorded in model.pt).")
@click.option("--epoch-size", type=int, default=None, help="Samples per epoch of weighted sources (default: all).")
@click.option("--classes", "subset_classes", default=None, metavar="A,B,...",
              help="Train on these classes only (shards without them are never read).")
@click.option("--keys", "subset_keys", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A file of sample keys, one per line: train on those only.")
@click.option("--where", "subset_where", default=None, metavar="EXPR",
              help="A filter on each sample's metadata, e.g. \"width >= 256 and mode == 'RGB'\".")
@click.option("--max-samples", "subset_max", type=int, default=None,
              help="At most this many samples of each source (after the other filters, in manifest order).")
@shard_source_option()
@click.option("--exclude-keys", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A file of sample keys, one per line, left out of training (the rest keep their order); may be "
                   "added or extended with --resume: the rest of the interrupted epoch drops them too.")
@click.option("--record-keys", is_flag=True,
              help="Debugging aid: append the keys each step was fed to RUN_DIR/keys.jsonl (shards lineage "
                   "computes them without it).")
@click.option("--task", type=click.Choice(TASKS), default="auto",
              help="auto: regression when features.json records a float target (pack-shards --table), "
                   "else classification.")
@click.option("--loss", type=click.Choice(LOSSES), default="mse",
              help="Regression loss on targets standardised with the train split's mean and std.")
@click.option("--head", type=click.Choice(HEADS), default="linear",
              help="Classifier (or regression) head on features; logreg: scikit-learn's LogisticRegression fitted "
                   "full-batch with L-BFGS on the train features held in memory (one fit, no epochs).")
@click.option("--standardize/--no-standardize", default=None, show_default=False,
              help="Standardise features with the train split's per-dimension mean and std (recorded in the run). "
                   "Default: on for --head logreg, off for linear and mlp.")
@click.option("--logreg-c", type=float, default=None,
              help="--head logreg's inverse L2 strength C, as scikit-learn's. Default: chosen on a held-out 20% "
                   "of train from 1e-4 to 1e4, then refit on all of it.")
@click.option("--hidden-dim", type=int, default=512, help="Hidden width of the mlp head.")
@click.option("--dropout", type=float, default=0.0, help="Dropout before the mlp head's last layer.")
@click.option("--model", default="resnet18", help="torchvision classification model, for image shards.")
@click.option("--weights", type=click.Path(dir_okay=False), default=None,
              help="Local weights file to fine-tune from (loaded with weights_only=True; classifier re-initialised "
                   "when the class count differs).")
@click.option("--image-size", type=int, default=224, help="Crop size of the image transforms.")
@click.option("--decode", type=click.Choice(STREAM_DECODES), default=DEFAULT_DECODE, show_default=True,
              help="Image input: fast = uint8 DCT-scaled decode and crop-then-resize in workers, normalised per batch "
                   "on the device; standard = PIL + torchvision transforms in workers (the reference).")
@click.option("--fast-decode", is_flag=True,
              help="--decode standard only: let PIL decode JPEGs at reduced size when the crop is much smaller.")
@click.option("--epochs", type=int, default=10)
@click.option("--batch-size", type=int, default=256, help="Per process (under torchrun the global batch is N x this).")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="sgd", help="SGD (Nesterov momentum) or AdamW.")
@click.option("--lr", type=float, default=None, help="Peak learning rate. Default: 0.1 for sgd, 0.001 for adamw.")
@click.option("--momentum", type=float, default=0.9)
@click.option("--warmup-epochs", type=float, default=0.0, help="Linear warmup before the cosine decay.")
@click.option("--weight-decay", type=float, default=1e-4, help="Applied to weights, not biases or norms.")
@click.option("--label-smoothing", type=float, default=0.0)
@click.option("--class-weighted-loss", is_flag=True, help="Weight the loss by inverse class frequency.")
@click.option("--balanced-sampler", is_flag=True, help="Sample classes evenly (seeded) instead of weighting the loss.")
@seed_option("the data order, the augmentations and the model's initialisation")
@click.option("--workers", type=WorkerCount(), default=None,
              help="Loader workers (processes or threads: one plan, one resume layout), or 'auto' (= --run-mode "
                   f"auto). Default: for image shards {WORKERS_RULE}; for feature folders in this process "
                   "(workers only slow feature rows down).")
@click.option("--run-mode", type=click.Choice(RUN_MODES), default=None,
              help="How the workers run: processes (DataLoader workers), threads (in this process: no IPC, for "
                   "decoders that release the GIL), auto (each tried over the first batches, the lowest step time "
                   "kept; the trial is in metrics.jsonl and the report). Default: processes.")
@click.option("--worker-threads", type=click.IntRange(1, 64), default=1,
              help="Decode threads inside each worker process (SPDL's multi-threading in multi-processing), or "
                   "shared by the worker threads with --run-mode threads.")
@click.option("--prefetch", type=int, default=2,
              help="Feature batches a background thread gathers ahead of the training step (0: none).")
@click.option("--feature-window", type=int, default=0,
              help="Features: shuffle within windows of this many rows of the epoch's shard order and read the "
                   "next window while this one trains, for a cold or larger-than-memory cache (0: shuffle whole).")
@click.option("--stall-timeout", type=float, default=600.0, show_default=True,
              help="Seconds without a batch (or a worker process gone) before the DataLoader workers are restarted "
                   "at the exact position; a sample a worker hangs or dies on twice is quarantined (0: off).")
@click.option("--resume-audit", type=click.Choice(RESUME_AUDITS), default="refuse", show_default=True,
              help="At --resume, check the saved loader state's record of the batches fed and to come against the "
                   "plan, and the first batches fed after it: refuse a mismatch (one line naming the batch and key), "
                   "warn, or off.")
@click.option("--amp", is_flag=True, help="Mixed precision (float16 autocast + GradScaler); CUDA only.")
@device_option("Under torchrun, cuda is each process's local-rank GPU.")
@click.option("--train-split", default="train")
@click.option("--val-split", default="val", help="Split to validate on every epoch.")
@click.option("--checkpoint-every", type=int, default=0, help="Also write last.pt every N steps (0: epoch ends only).")
@click.option("--resume", is_flag=True, help="Continue the run in --out exactly from last.pt (start if there is none).")
@click.option("--dry-run", is_flag=True, help="Print one batch's shape, dtype, value range and labels, then exit.")
@overwrite_option("a different run in --out")
@click.option("--no-report", is_flag=True, help="Do not write report.html into the run folder.")
@click.option("--cache-images", is_flag=True,
              help="Image shards, fast pipeline: keep decoded images in memory after the first epoch (train views "
                   "then crop from images bounded to image-size / 0.875), so later epochs skip decoding.")
@click.option("--memory-limit", type=ByteSize(), default=None,
              help="With --cache-images: at most this much per process (8G); over it, the rest is decoded every "
                   "epoch. With --head logreg: what the train features may fill, else it refuses. Default: half of "
                   "what the job (its cgroup, else the machine) has left.")
@click.option("--stop-after-steps", type=int, default=None, hidden=True,
              help="Testing and profiling: return after N steps as if killed (nothing more is written).")
@memory_budget_option
@s3_options
@cache_options
@quiet_option
@version_option
@handle_errors
def train_command(path: str | None, out_dir: str, data_options: tuple[str, ...], class_map: str,
                  epoch_size: int | None, subset_classes: str | None, subset_keys: str | None,
                  subset_where: str | None, subset_max: int | None, exclude_keys: str | None, record_keys: bool,
                  task: str, loss: str, head: str, standardize: bool | None, logreg_c: float | None, hidden_dim: int,
                  dropout: float, model: str, weights: str | None, image_size: int, decode: str, fast_decode: bool,
                  epochs: int, batch_size: int, optimizer: str, lr: float | None, momentum: float, warmup_epochs: float,
                  weight_decay: float, label_smoothing: float, class_weighted_loss: bool, balanced_sampler: bool,
                  seed: int, workers: int | str | None, run_mode: str | None, worker_threads: int, prefetch: int, feature_window: int, stall_timeout: float,
                  resume_audit: str, memory_budget: int | None, amp: bool, device: str, train_split: str,
                  val_split: str, checkpoint_every: int, resume: bool, dry_run: bool, overwrite: bool,
                  stop_after_steps: int | None, no_report: bool, cache_images: bool, memory_limit: int | None,
                  quiet: bool, s3, cache, source: str | None) -> None:
    """Train a classifier from image shards (dataset.json) or cached features (features.json) in PATH, or a
    regression head on a table's float target (pack-shards --table). Several --data sources mix into one epoch
    (by weight, repeat or choose); --classes, --keys, --where and --max-samples train on a subset; no repacking.

    Prints one JSON line with val_top1 (val_r2, val_mse and val_mae for regression), data_wait_share and run_dir.
    Under torchrun, every process runs this command; rank 0 writes the run folder.
    """
    started = time.perf_counter()  # the time to first batch counts from here (train.run.first_batch)
    from train.run.loop import train

    cfg = train_config(path, out=out_dir, data=data_options, class_map=class_map, epoch_size=epoch_size,
                       classes=class_names(subset_classes), keys=subset_keys, where=subset_where,
                       max_samples=subset_max, source=source, exclude_keys=exclude_keys, record_keys=record_keys,
                       task=task, loss=loss, head=head, standardize=standardize, logreg_c=logreg_c,
                       hidden_dim=hidden_dim, dropout=dropout, model=model, weights=weights, image_size=image_size,
                       decode=decode, fast_decode=fast_decode, epochs=epochs, batch_size=batch_size,
                       optimizer=optimizer, lr=lr, momentum=momentum, warmup_epochs=warmup_epochs,
                       weight_decay=weight_decay, label_smoothing=label_smoothing,
                       class_weighted_loss=class_weighted_loss, balanced_sampler=balanced_sampler, seed=seed,
                       workers=workers, run_mode=run_mode, worker_threads=worker_threads, prefetch=prefetch,
                       feature_window=feature_window, stall_timeout=stall_timeout, resume_audit=resume_audit,
                       memory_budget=memory_budget,
                       amp=amp, device=device, train_split=train_split, val_split=val_split,
                       checkpoint_every=checkpoint_every, resume=resume, dry_run=dry_run, overwrite=overwrite,
                       no_report=no_report, cache_images=cache_images, memory_limit=memory_limit,
                       stop_after_steps=stop_after_steps, quiet=quiet, s3=s3, cache=cache)
    # Caught from here on, so DataLoader workers forked later inherit the handlers (shards.jobs.preemption).
    with stop_signals("train-from-shards") as stop:
        summary = train(cfg, started=started, stop=stop)
    if int(os.environ.get("RANK", "0")) == 0:
        emit_json(summary)
