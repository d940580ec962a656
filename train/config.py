"""The training run's configuration: one frozen dataclass, validated on entry, saved into the run folder.

Everything that changes the numbers lives here, so ``config.json`` and every checkpoint record how a run was made
and ``--resume`` can refuse to continue a run with different settings.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from shards.atomic import check_local_output
from shards.errors import InputError
from shards.stream.options import check_decode

DATA_KINDS = ("auto", "images", "features")
CLASS_MAPS = ("same", "union")  # as shards.select.mixture.CLASS_MAPS, without importing the reader
# logreg: a full-batch L-BFGS logistic regression on features held in memory (train.model.probe), fitted as scikit-learn's.
HEADS = ("linear", "mlp", "logreg")
OPTIMIZERS = ("sgd", "adamw")
# The decode modes are defined and validated in shards.stream.options; training defaults to "fast" (the library
# to "standard") because the loop owns the device-side normalisation the fast decode needs.
DEFAULT_DECODE = "fast"
DEVICES = ("auto", "cpu", "cuda")
# auto: regression when features.json's config.target says so (a table with a float target), else classification.
TASKS = ("auto", "classification", "regression")
LOSSES = ("mse", "huber")  # regression, on standardised targets (train.model.regression); classification: cross-entropy
DEFAULT_LR = {"sgd": 0.1, "adamw": 1e-3}

# Fields a resumed run may change without it being a different run: they steer the process, not the numbers
# (``epochs`` extends a run; the schedule then follows the new length; other ``workers`` continue the interrupted
# epoch with exactly the samples it had left, see shards.position.elastic).
RESUMABLE_CHANGES = frozenset(
    {"epochs", "resume", "overwrite", "quiet", "dry_run", "checkpoint_every", "stop_after_steps", "device",
     "storage_options", "workers", "cache_dir", "cache_limit", "cache_fallback", "cache_local", "cache_eviction",
     "cache_prefetch_bytes", "report",
     "memory_limit", "record_keys", "exclude_keys", "stall_timeout"}
)


@dataclass(frozen=True)
class TrainConfig:
    """How to train: data, model, optimisation, run folder. ``lr=None`` means the optimizer's usual default."""

    data_path: str
    out_dir: str
    data: str = "auto"
    task: str = "auto"
    loss: str = "mse"
    head: str = "linear"
    # Features standardised with the train split's mean and std (train.model.standardize); None: the head's default,
    # on for logreg (the probe scikit-learn users compare with is fitted on standardised features), off for the
    # SGD heads (their recorded results stay reproducible; --standardize turns it on). Resolved on entry.
    standardize: bool | None = None
    logreg_c: float | None = None  # --head logreg's C (scikit-learn's); None: chosen on a held-out part of train
    hidden_dim: int = 512
    dropout: float = 0.0
    model: str = "resnet18"
    weights: str | None = None
    image_size: int = 224
    decode: str = DEFAULT_DECODE
    fast_decode: bool = False
    epochs: int = 10
    batch_size: int = 256
    optimizer: str = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    warmup_epochs: float = 0.0
    weight_decay: float = 1e-4
    label_smoothing: float = 0.0
    class_weighted_loss: bool = False
    balanced_sampler: bool = False
    seed: int = 0
    workers: int | None = None
    prefetch: int = 2  # feature batches a background thread gathers ahead (0: none)
    feature_window: int = 0  # features: permute within windows of this many rows, read one window ahead (0: whole)
    stall_timeout: float = 600.0  # seconds without a batch before DataLoader workers are restarted (0: never)
    amp: bool = False
    device: str = "auto"
    train_split: str = "train"
    val_split: str = "val"
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False
    dry_run: bool = False
    quiet: bool = False
    # Test and profiling hook: return after this many optimizer steps without writing anything more, exactly as
    # if the process had been killed there.
    stop_after_steps: int | None = None
    # How to reach an s3:// data_path (shards.transport.s3.S3Options fields; never credentials).
    storage_options: dict | None = None
    # The node-local shard cache (shards.cache.cached_shards): a folder on this node's local disk, its size limit
    # in bytes, whether a full disk falls back to the source, whether local paths are cached too. Steering only:
    # a requeued run may use another node's folder.
    cache_dir: str | None = None
    cache_limit: int | None = None
    cache_fallback: bool = False
    cache_eviction: str = "next-use"
    cache_prefetch_bytes: int | None = None
    cache_local: bool = False
    report: bool = True  # report.html in the run folder (shards.report), redrawn as epochs end (at most every 30 s) and at the end
    # Decoded images kept in memory after the first epoch (shards.cache.images). Part of the run: train views
    # are then cropped from images bounded to size / 0.875, so a resume may not switch it. memory_limit (bytes;
    # None: half of what the job has left, shared by the node's ranks) only decides how much is kept: steering.
    # With --head logreg it is the budget the train features must fit in (train.model.probe).
    cache_images: bool = False
    memory_limit: int | None = None
    # A mixture (shards.select.mixture): the sources beside data_path (which is the first), each
    # {"path", "weight", "repeat", "choose"}; how class lists combine; a subset of every source
    # {"classes", "keys", "where", "max_samples"}; the samples per epoch of weighted sources.
    sources: list = dataclasses.field(default_factory=list)
    class_map: str = "same"
    subset: dict | None = None
    epoch_size: int | None = None
    # Lineage (train.run.lineage): append the keys each step was fed to keys.jsonl (a debugging aid), and a file of
    # sample keys (one per line) left out of training from now on; both may be given or changed at a resume.
    record_keys: bool = False
    exclude_keys: str | None = None

    def __post_init__(self) -> None:
        # A run folder is local: checked on the string as given (a path would turn s3://b/p into ./s3:/b/p), then
        # made absolute so config.json names the same folder from any working directory.
        check_local_output(self.out_dir)
        object.__setattr__(self, "out_dir", os.path.abspath(self.out_dir))
        _choice("data", self.data, DATA_KINDS)
        _choice("class_map", self.class_map, CLASS_MAPS)
        object.__setattr__(self, "sources", [dict(s) for s in self.sources])  # lists: equal after a JSON round trip
        if self.epoch_size is not None and not any(s.get("weight") is not None for s in self.sources):
            raise InputError("epoch_size applies to weighted sources (--data PATH:WEIGHT)")
        _choice("head", self.head, HEADS)
        if self.standardize is None:
            object.__setattr__(self, "standardize", self.head == "logreg")
        self._check_logreg()
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("task", self.task, TASKS)
        _choice("loss", self.loss, LOSSES)
        check_decode(self.decode, where="train-from-shards (TrainConfig.decode)")
        if self.decode == "fast" and self.fast_decode:
            raise InputError("fast_decode applies to decode='standard'; the fast decode drafts JPEGs itself")
        _choice("device", self.device, DEVICES)
        _positive("epochs", self.epochs)
        _positive("batch_size", self.batch_size)
        _positive("hidden_dim", self.hidden_dim)
        _positive("image_size", self.image_size)
        if self.lr is not None and not self.lr > 0:
            raise InputError(f"lr={self.lr!r} must be > 0")
        for name in ("warmup_epochs", "weight_decay", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise InputError(f"{name}={getattr(self, name)!r} must be >= 0")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise InputError(f"label_smoothing={self.label_smoothing!r} must be in [0, 1)")
        if not 0.0 <= self.dropout < 1.0:
            raise InputError(f"dropout={self.dropout!r} must be in [0, 1)")
        if not 0.0 <= self.momentum < 1.0:
            raise InputError(f"momentum={self.momentum!r} must be in [0, 1)")
        if self.warmup_epochs > self.epochs:
            raise InputError(f"warmup_epochs={self.warmup_epochs!r} is longer than epochs={self.epochs}")
        if self.prefetch < 0:
            raise InputError(f"prefetch={self.prefetch!r} must be >= 0")
        if self.feature_window < 0:
            raise InputError(f"feature_window={self.feature_window!r} must be >= 0")
        if self.workers is not None and self.workers < 0:
            raise InputError(f"workers={self.workers!r} must be >= 0")
        if not self.stall_timeout >= 0:
            raise InputError(f"stall_timeout={self.stall_timeout!r} must be >= 0 seconds (0: no stall recovery)")
        if self.class_weighted_loss and self.balanced_sampler:
            raise InputError("class_weighted_loss and balanced_sampler both correct the imbalance; choose one")
        if self.stop_after_steps is not None and self.stop_after_steps < 1:
            raise InputError(f"stop_after_steps={self.stop_after_steps!r} must be >= 1")
        if self.resume and self.overwrite:
            raise InputError("resume and overwrite contradict each other; choose one")
        if self.memory_limit is not None and (not (self.cache_images or self.head == "logreg")
                                              or self.memory_limit < 0):
            raise InputError(f"memory_limit={self.memory_limit!r} sizes the image cache (give cache_images too) or "
                             "the features of head='logreg', and must be >= 0")
        if self.cache_images and self.decode != "fast":
            raise InputError("cache_images needs decode='fast' (its uint8 outputs are what is kept)")
        if self.train_split == self.val_split:
            raise InputError(f"train_split and val_split are both {self.val_split!r}")

    def _check_logreg(self) -> None:
        """The probe fits the plain cross-entropy of scikit-learn's model: options that change the loss are refused."""
        if self.logreg_c is not None and (self.head != "logreg" or not self.logreg_c > 0):
            raise InputError(f"logreg_c={self.logreg_c!r} is --head logreg's C: give head='logreg' and a C > 0")
        if self.head != "logreg":
            return
        for name, used in (("class_weighted_loss", self.class_weighted_loss),
                           ("balanced_sampler", self.balanced_sampler), ("label_smoothing", self.label_smoothing)):
            if used:
                raise InputError(f"{name} does not apply to head='logreg', which fits scikit-learn's plain "
                                 "LogisticRegression objective")

    @property
    def mixed(self) -> bool:
        """Whether the input is several sources or a subset (``shards.select.mixture``), not one whole folder."""
        return bool(self.sources) or bool(self.subset)

    @property
    def shard_cache(self) -> Any:
        """The node-local shard cache the ``cache_*`` fields ask for, as ``open_dataset`` takes it (a
        ``shards.cache.node.ShardCache``); with no ``cache_dir``, ``$SHARDCACHE_CACHE_DIR`` or none."""
        from shards.cache.node import ShardCache

        tuned = {} if self.cache_prefetch_bytes is None else {"prefetch_bytes": self.cache_prefetch_bytes}
        return ShardCache(self.cache_dir or None, self.cache_limit if self.cache_dir else None,
                          fallback=self.cache_fallback, local=True if self.cache_local else None,
                          eviction=self.cache_eviction, **tuned)

    @property
    def resolved_lr(self) -> float:
        return DEFAULT_LR[self.optimizer] if self.lr is None else self.lr

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        """A recorded config; one written before ``pipeline`` became ``decode`` (same values) reads as its run."""
        known = {f.name for f in dataclasses.fields(cls)}
        if "pipeline" in data and "decode" not in data:
            data = {**data, "decode": data["pipeline"]}
        return cls(**{k: v for k, v in data.items() if k in known})

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def differences(self, other: "TrainConfig") -> list[str]:
        """Fields that make ``other`` a different run (ignoring the ones a resume may change)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return sorted(k for k in mine if k not in RESUMABLE_CHANGES and mine[k] != theirs.get(k))


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InputError(f"{name}={value!r} is not one of {', '.join(choices)}")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise InputError(f"{name}={value!r} must be a positive integer")
