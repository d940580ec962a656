"""The option groups of a training run: small frozen dataclasses, each validated on entry, as ``open_dataset``'s.

``TrainConfig`` (``train.config``) is made of these six, one per ``--help`` section of ``train-from-shards``:
``DataOptions`` (what is read), ``ModelOptions`` (what is trained), ``OptimOptions`` (how it is fitted: the
numbers), ``LoaderOptions`` (how samples reach the step), ``CacheOptions`` (where shards and decoded images are
kept on the way) and ``RunOptions`` (the run folder and the process). A group checks its own fields and names them
by their path in ``config.json`` (``optim.lr=-1.0 must be > 0``); rules that join two groups are ``TrainConfig``'s.
Nothing heavy is imported, so the command line can share the vocabularies below without loading torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from shards.atomic import check_local_output
from shards.cache.node import EVICTION_RULES, NEXT_USE
from shards.errors import InputError
from shards.jobs.device_names import check_device_name
from shards.position.audit import MODES as RESUME_AUDITS
from shards.stream.options import check_decode

CLASS_MAPS = ("same", "union")  # as shards.select.mixture.CLASS_MAPS, without importing the reader
# logreg: a full-batch L-BFGS logistic regression on features held in memory (train.model.probe), fitted as scikit-learn's.
HEADS = ("linear", "mlp", "logreg")
OPTIMIZERS = ("sgd", "adamw")
# The decode modes are defined and validated in shards.stream.options; training defaults to "fast" (the library
# to "standard") because the loop owns the device-side normalisation the fast decode needs.
DEFAULT_DECODE = "fast"
RUN_MODES = ("processes", "threads", "auto")  # the loader's run mode (shards.loader)
# auto: regression when features.json's config.target says so (a table with a float target), else classification.
TASKS = ("auto", "classification", "regression")
LOSSES = ("mse", "huber")  # regression, on standardised targets (train.model.regression); classification: cross-entropy
DEFAULT_LR = {"sgd": 0.1, "adamw": 1e-3}


@dataclass(frozen=True)
class DataOptions:
    """What the run reads. ``path`` is the dataset or feature folder (the first source of a mixture). A mixture
    (``shards.select.mixture``): ``sources``, each ``{"path", "weight", "repeat", "choose"}``; how their class
    lists combine (``class_map``); a ``subset`` of every source ``{"classes", "keys", "where", "max_samples"}``;
    the samples per epoch of weighted sources (``epoch_size``). ``exclude_keys``: a file of sample keys (one per
    line) left out of training from now on (train.run.lineage); it may be given or changed at a resume. ``source``:
    where the shards are when not beside the manifest (the tars of an index made by ``shards index``): the
    caller's choice, never the manifest's; it may change at a resume (the checksums say they are the same bytes)."""

    path: str
    sources: list = dataclasses.field(default_factory=list)
    source: str | None = None
    class_map: str = "same"
    subset: dict | None = None
    epoch_size: int | None = None
    train_split: str = "train"
    val_split: str = "val"
    exclude_keys: str | None = None

    def __post_init__(self) -> None:
        _choice("data.class_map", self.class_map, CLASS_MAPS)
        object.__setattr__(self, "sources", [dict(s) for s in self.sources])  # lists: equal after a JSON round trip
        if self.epoch_size is not None and not any(s.get("weight") is not None for s in self.sources):
            raise InputError("data.epoch_size applies to weighted sources (--data PATH:WEIGHT)")
        if self.train_split == self.val_split:
            raise InputError(f"data.train_split and data.val_split are both {self.val_split!r}")

    @property
    def mixed(self) -> bool:
        """Whether the input is several sources or a subset (``shards.select.mixture``), not one whole folder."""
        return bool(self.sources) or bool(self.subset)


@dataclass(frozen=True)
class ModelOptions:
    """What is trained: a head on features (``head``, ``hidden_dim``, ``dropout``) or a torchvision model on images
    (``name``, fine-tuned from a local ``weights`` file when given), for ``task``."""

    task: str = "auto"
    head: str = "linear"
    # Features standardised with the train split's mean and std (train.model.standardize); None: the head's default,
    # on for logreg (the probe scikit-learn users compare with is fitted on standardised features), off for the
    # SGD heads (their recorded results stay reproducible; --standardize turns it on). Resolved on entry.
    standardize: bool | None = None
    logreg_c: float | None = None  # --head logreg's C (scikit-learn's); None: chosen on a held-out part of train
    hidden_dim: int = 512
    dropout: float = 0.0
    name: str = "resnet18"
    weights: str | None = None

    def __post_init__(self) -> None:
        _choice("model.task", self.task, TASKS)
        _choice("model.head", self.head, HEADS)
        if self.standardize is None:
            object.__setattr__(self, "standardize", self.head == "logreg")
        if self.logreg_c is not None and (self.head != "logreg" or not self.logreg_c > 0):
            raise InputError(f"model.logreg_c={self.logreg_c!r} is --head logreg's C: give head='logreg' and a C > 0")
        _positive("model.hidden_dim", self.hidden_dim)
        _fraction("model.dropout", self.dropout)


@dataclass(frozen=True)
class OptimOptions:
    """How the model is fitted: everything here changes the numbers. ``lr=None`` means the optimizer's usual
    default (``resolved_lr``); ``loss`` is the regression loss (classification trains with cross-entropy)."""

    epochs: int = 10
    batch_size: int = 256
    optimizer: str = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    warmup_epochs: float = 0.0
    weight_decay: float = 1e-4
    loss: str = "mse"
    label_smoothing: float = 0.0
    class_weighted_loss: bool = False
    balanced_sampler: bool = False
    seed: int = 0
    amp: bool = False

    def __post_init__(self) -> None:
        _choice("optim.optimizer", self.optimizer, OPTIMIZERS)
        _choice("optim.loss", self.loss, LOSSES)
        _positive("optim.epochs", self.epochs)
        _positive("optim.batch_size", self.batch_size)
        if self.lr is not None and not 0 < self.lr < math.inf:
            raise InputError(f"optim.lr={self.lr!r} must be a finite number > 0")
        _not_negative("optim.warmup_epochs", self.warmup_epochs)
        _not_negative("optim.weight_decay", self.weight_decay)
        _fraction("optim.label_smoothing", self.label_smoothing)
        _fraction("optim.momentum", self.momentum)
        if self.warmup_epochs > self.epochs:
            raise InputError(f"optim.warmup_epochs={self.warmup_epochs!r} is longer than optim.epochs={self.epochs}")
        if self.class_weighted_loss and self.balanced_sampler:
            raise InputError("optim.class_weighted_loss and optim.balanced_sampler both correct the imbalance; "
                             "choose one")

    @property
    def resolved_lr(self) -> float:
        return DEFAULT_LR[self.optimizer] if self.lr is None else self.lr


@dataclass(frozen=True)
class LoaderOptions:
    """How samples reach the training step: the image pipeline (``image_size``, ``decode``, ``fast_decode``) and
    the loader's processes and threads: ``workers`` logical workers (None: the loader's choice), run as
    ``run_mode`` ``processes`` (with ``worker_threads`` decode threads inside each), ``threads`` (threads of the
    training process; ``worker_threads`` > 1: that many decode threads shared by them) or ``auto`` (the one of them
    with the lowest step time, ``shards.loader.auto``)."""

    image_size: int = 224
    decode: str = DEFAULT_DECODE
    fast_decode: bool = False
    workers: int | None = None
    run_mode: str = "processes"
    worker_threads: int = 1
    prefetch: int = 2  # feature batches a background thread gathers ahead (0: none)
    feature_window: int = 0  # features: permute within windows of this many rows, read one window ahead (0: whole)
    stall_timeout: float = 600.0  # seconds without a batch before DataLoader workers are restarted (0: never)
    resume_audit: str = "refuse"  # a resume that disagrees with the plan: refuse, warn, off (shards.position.audit)
    memory_budget: int | None = None  # bytes each process's loaders hold in flight (None: shards.loader.budget's default)

    def __post_init__(self) -> None:
        _positive("loader.image_size", self.image_size)
        check_decode(self.decode, field="loader.decode", where="train-from-shards")
        if self.decode == "fast" and self.fast_decode:
            raise InputError("loader.fast_decode applies to decode='standard'; the fast decode drafts JPEGs itself")
        if self.workers is not None:
            _not_negative("loader.workers", self.workers)
        if self.run_mode not in RUN_MODES:
            raise InputError(f"loader.run_mode={self.run_mode!r} is not one of {', '.join(RUN_MODES)}")
        if self.run_mode != "processes" and self.workers == 0:
            raise InputError(f"loader.run_mode={self.run_mode!r} needs workers >= 1 (workers=0: in the training "
                             "process, no mode to choose)")
        _positive("loader.worker_threads", self.worker_threads)
        _not_negative("loader.prefetch", self.prefetch)
        _not_negative("loader.feature_window", self.feature_window)
        if self.resume_audit not in RESUME_AUDITS:
            raise InputError(f"loader.resume_audit={self.resume_audit!r} is not one of {', '.join(RESUME_AUDITS)}")
        if self.memory_budget is not None:
            _positive("loader.memory_budget", self.memory_budget)
        if not self.stall_timeout >= 0:
            raise InputError(f"loader.stall_timeout={self.stall_timeout!r} must be >= 0 seconds (0: no stall "
                             "recovery)")

    def mode_text(self) -> str | None:
        """``workers``, ``run_mode`` and ``worker_threads`` (the CLI's three options, as config.json records them)
        as the run mode's one text form, which ``RunMode.parse`` reads (``shards.loader.loader``); None: the
        library's default for the dataset. ``worker_threads`` 1 is no decode threads beside the workers."""
        if self.run_mode == "auto":
            return "auto" if self.workers is None else f"auto:{self.workers}"
        if self.workers is None and self.run_mode == "processes" and self.worker_threads == 1:
            return None
        if self.workers == 0:
            return "in-process"
        text = self.run_mode if self.workers is None else f"{self.run_mode}:{self.workers}"
        return text + (f",decoders={self.worker_threads}" if self.worker_threads > 1 else "")


@dataclass(frozen=True)
class CacheOptions:
    """Where shards and decoded images are kept on the way. ``storage_options``: how to reach ``s3://`` sources
    (``shards.transport.s3.S3Options`` fields; never credentials). The node-local shard cache
    (``shards.cache.cached_shards``, fields as ``ShardCache``'s): a folder on this node's local disk, its size
    limit in bytes, whether a full disk falls back to the source, whether local paths are cached too; steering
    only, a requeued run may use another node's folder. ``images``: decoded images kept in memory after the first
    epoch (``shards.cache.images``); part of the run, since train views are then cropped from images bounded to
    size / 0.875. ``memory_limit`` (bytes; None: half of what the job has left, shared by the node's ranks) only
    decides how much is kept; with ``--head logreg`` it is the budget the train features must fit in."""

    storage_options: dict | None = None
    dir: str | None = None
    limit: int | None = None
    fallback: bool = False
    eviction: str = NEXT_USE
    prefetch_bytes: int | None = None
    local: bool = False
    images: bool = False
    memory_limit: int | None = None

    def __post_init__(self) -> None:
        _choice("cache.eviction", self.eviction, EVICTION_RULES)
        for name in ("limit", "prefetch_bytes", "memory_limit"):
            if getattr(self, name) is not None:
                _not_negative(f"cache.{name}", getattr(self, name))

    @property
    def shard_cache(self) -> Any:
        """The node-local shard cache these fields ask for, as ``open_dataset`` takes it (a
        ``shards.cache.node.ShardCache``); with no ``dir``, ``$SHARDCACHE_CACHE_DIR`` or none."""
        from shards.cache.node import ShardCache

        tuned = {} if self.prefetch_bytes is None else {"prefetch_bytes": self.prefetch_bytes}
        return ShardCache(self.dir or None, self.limit if self.dir else None, fallback=self.fallback,
                          local=True if self.local else None, eviction=self.eviction, **tuned)


@dataclass(frozen=True)
class RunOptions:
    """The run folder and the process: what a resumed run may change freely (``out_dir`` aside)."""

    out_dir: str
    device: str = "auto"
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False
    dry_run: bool = False
    quiet: bool = False
    # Test and profiling hook: return after this many optimizer steps without writing anything more, exactly as
    # if the process had been killed there.
    stop_after_steps: int | None = None
    report: bool = True  # report.html in the run folder (shards.report), redrawn as epochs end (at most every 30 s) and at the end
    record_keys: bool = False  # append the keys each step was fed to keys.jsonl (train.run.lineage): a debugging aid

    def __post_init__(self) -> None:
        # A run folder is local: checked on the string as given (a path would turn s3://b/p into ./s3:/b/p), then
        # made absolute so config.json names the same folder from any working directory.
        check_local_output(self.out_dir)
        object.__setattr__(self, "out_dir", os.path.abspath(self.out_dir))
        check_device_name(self.device, "run.device")  # the rule --device parses with in every command
        _not_negative("run.checkpoint_every", self.checkpoint_every)
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            raise InputError(f"run.stop_after_steps={self.stop_after_steps!r} must be >= 1")
        if self.resume and self.overwrite:
            raise InputError("run.resume and run.overwrite contradict each other; choose one")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InputError(f"{name}={value!r} is not one of {', '.join(choices)}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise InputError(f"{name}={value!r} must be a positive integer")


def _not_negative(name: str, value: float) -> None:
    if not 0 <= value < math.inf:
        raise InputError(f"{name}={value!r} must be a finite number >= 0")


def _fraction(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise InputError(f"{name}={value!r} must be in [0, 1)")
