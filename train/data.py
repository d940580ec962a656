"""From a shards folder to train and val loaders: read the manifest, check it, open the streaming reader.

The kind of input (image shards or cached features) comes from the manifest, never from globbing. A feature cache
is checked against the dataset it was computed from (``shards.check.freshness``), so a stale cache is refused before
any training starts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

import shards
from shards.check.freshness import check_features_fresh
from shards.cache.node_index import STAT_NAMES
from shards.errors import InputError, ManifestError
from shards.loader.loader import resolve_mode, worth_pinning
from shards.loader.watchdog import StallPolicy
from shards.transport.location import locate
from shards.transport.manifest_io import load_manifest_at
from shards.manifest import DATASET_FILE, FEATURES_FILE, DatasetManifest, FeatureManifest
from shards.runrecord import DataCall, LoaderCall
from shards.image.transforms import TransformSpec
from shards.select.columns import open_columns
from shards.select.key_set import read_keys
from shards.select.mixture import MixOptions, SourceSpec, Subset, unweighted
from shards.stream.options import Decode, Distributed, MemoryCache, Remote, Sampling
from shards.select.selection import combined_classes, excluded_rows
from shards.units import human_bytes
from train.applies import check_options_apply
from train.config import TrainConfig
from train.model.regression import manifest_task, resolve_task
from train.model.models import uses_channels_last
from train.distributed import DistContext
from train.memory import loader_budget

log = logging.getLogger("shardcache.train")
# The node-cache counters a run reports per epoch (summed over ranks): metrics.jsonl's cache_hit_rate and
# fetched_bytes come from these, and its ``cache`` row holds them all (docs/caching.md, "Counters").
CACHE_COUNTERS = STAT_NAMES


@dataclass
class RunData:
    """Everything the loop needs from the data side."""

    kind: str  # "images" or "features"
    manifest: DatasetManifest | FeatureManifest
    train_loader: Any
    val_loader: Any
    workers: int
    eval_transform: TransformSpec | None = None
    # The fast pipeline yields uint8 batches: this turns them into the model input on the device.
    normalize: torch.nn.Module | None = None
    open_s: float = 0.0  # wall seconds of the two open_dataset calls (train.run.first_batch's open_s)
    train_call: DataCall | None = None  # the train loader's calls, as the run record keeps them
    memory_budget: dict[str, Any] | None = None  # the loaders' budget as resolved (run.json, train.memory)

    @property
    def classes(self) -> list[str]:
        return list(self.manifest.classes)

    @property
    def features_dim(self) -> int | None:
        return self.manifest.features_dim if self.kind == "features" else None

    @property
    def task(self) -> str:
        """What the loaders yield beside the inputs: float targets for regression (``--task`` checked to agree)."""
        return manifest_task(self.manifest)

    def close(self) -> None:
        """Stop the loaders' worker processes as the run ends (``Loader.close``), not at garbage collection."""
        for loader in (self.train_loader, self.val_loader):
            loader.close()

    def cache_counts(self) -> dict[str, int] | None:
        """This rank's node-cache counters (train and val readers together, all epochs so far), or None."""
        caches = [getattr(loader.dataset, "shard_cache", None) for loader in (self.train_loader, self.val_loader)]
        snapshots = [cache.stats.snapshot() for cache in caches if cache is not None]
        if not snapshots:
            return None
        return {name: sum(int(s[name]) for s in snapshots) for name in CACHE_COUNTERS}

    def train_class_counts(self, split: str) -> list[int]:
        return list(self.manifest.split(split).class_counts)

    @property
    def mixture(self) -> Any:
        """The train split's ``Mixture`` (several sources or a subset), or None."""
        return getattr(self.train_loader.dataset, "mixture", None)

    def mixture_record(self, cfg: TrainConfig) -> dict[str, Any] | None:
        """What the run folder records of a mixture: the class map, the epoch size, each source's composition."""
        mixture = self.mixture
        if mixture is None:
            return None
        return {"class_map": cfg.data.class_map, "classes": self.classes, "epoch_size": mixture.epoch_size,
                "sources": mixture.composition(self.classes)}

    def data_identity(self) -> str | None:
        """A digest of what the run trains on as its manifest records it (the features' config and every shard's
        sha256; an image dataset's shards), kept in each checkpoint: a ``--resume`` over features recomputed or a
        dataset repacked since would train on a mixture of the two, so it is refused (``Checkpoints.restore``)."""
        manifest = self.manifest
        if not isinstance(manifest, (FeatureManifest, DatasetManifest)):
            return None
        record = {"config_hash": getattr(manifest, "config_hash", None),
                  "shards": {name: [s.sha256 for s in split.shards] for name, split in sorted(manifest.splits.items())}}
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode("utf-8")).hexdigest()

    def feature_config(self) -> dict[str, Any]:
        """What a user of the trained head needs to reproduce its inputs (backbone, weights, transform)."""
        if not isinstance(self.manifest, FeatureManifest):
            return {}
        m = self.manifest
        return {"config": dict(m.config), "config_hash": m.config_hash, "features_dim": m.features_dim,
                "dtype": m.dtype, "views": m.views, "dataset_sha256": m.dataset_sha256}


def source_paths(cfg: TrainConfig) -> list[str]:
    return [str(s["path"]) for s in cfg.data.sources] or [cfg.data.path]


def source_specs(cfg: TrainConfig, *, weighted: bool = True) -> list[SourceSpec] | None:
    """The mixture's sources (``--data PATH[:WEIGHT]``, ``--classes``...), or None for one whole folder."""
    if not cfg.data.mixed:
        return None
    subset = Subset(**cfg.data.subset) if cfg.data.subset else Subset()
    rows = cfg.data.sources or [{"path": cfg.data.path}]
    specs = [SourceSpec(r["path"], r.get("weight"), r.get("repeat"), r.get("choose"), subset) for r in rows]
    return specs if weighted else list(unweighted(specs))


def check_splits(manifest: DatasetManifest | FeatureManifest, cfg: TrainConfig, path: str | None = None) -> None:
    for role, name in (("train", cfg.data.train_split), ("val", cfg.data.val_split)):
        if name not in manifest.splits:
            option = "--val-split" if role == "val" else "--train-split"
            raise ManifestError(f"no {role} split {name!r} (splits: {', '.join(sorted(manifest.splits))}); "
                                f"pack one or choose another with {option}",
                                path=str(locate(path or cfg.data.path).file(
                                    FEATURES_FILE if manifest.kind == "features" else DATASET_FILE)))
        if manifest.splits[name].samples == 0:
            raise ManifestError(f"the {role} split {name!r} holds no samples", path=path or cfg.data.path)


def prepare_manifest(cfg: TrainConfig) -> DatasetManifest | FeatureManifest:
    """Read and check everything about the input that can be wrong, before any process group or folder."""
    paths = source_paths(cfg)
    # What each folder holds (image shards or features) is what its manifest says: there is nothing to choose.
    manifests = [load_manifest_at(path, storage_options=cfg.cache.storage_options)[0] for path in paths]
    for path, one in zip(paths, manifests):
        if isinstance(one, FeatureManifest):
            check_features_fresh(path, one, storage_options=cfg.cache.storage_options)
        check_splits(one, cfg, path)
        check_options_apply(cfg, one.kind, path)
    manifest = manifests[0]
    if len(manifests) > 1:  # the mixture's classes; build_data puts in its combined splits
        manifest = manifest.replace(classes=tuple(combined_classes([m.classes for m in manifests], paths,
                                                                   cfg.data.class_map)))
    if resolve_task(cfg, manifest) == "classification" and len(manifest.classes) < 2:
        raise ManifestError(f"needs at least 2 classes, the manifest has {len(manifest.classes)}",
                            path=cfg.data.path)
    return manifest


def build_data(cfg: TrainConfig, manifest: DatasetManifest | FeatureManifest, ctx: DistContext) -> RunData:
    """Train and val loaders for this rank: train shuffled from the seed, val in manifest order."""
    kind = manifest.kind
    rank, world = (ctx.rank, ctx.world_size) if ctx.distributed else (0, 1)
    train_spec = eval_spec = None
    decode = Decode()
    if kind == "images":
        train_spec = TransformSpec(preset="train", size=cfg.loader.image_size)
        eval_spec = TransformSpec(preset="eval", size=cfg.loader.image_size)
        decode = Decode(cfg.loader.decode, draft=cfg.loader.fast_decode)
    sampling = Sampling(class_weights="balanced" if cfg.optim.balanced_sampler else None,
                        feature_window=cfg.loader.feature_window)
    budget = loader_budget(cfg, ctx, kind)  # its read-ahead is fixed when the datasets open
    remote = Remote(base_url=cfg.data.source, storage_options=budget.storage_options,
                    shard_cache=cfg.cache.shard_cache)
    train_images, val_images = image_caches(cfg, manifest, ctx)
    specs = source_specs(cfg)
    if specs and cfg.data.exclude_keys:  # a mixture leaves them out where it selects (the val split keeps them)
        specs = [dataclasses.replace(s, subset=dataclasses.replace(s.subset, exclude_keys=cfg.data.exclude_keys))
                 for s in specs]
    nodes = None if specs else affinity_nodes(cfg, manifest, ctx)
    # The train call's arguments, recorded as the run record's DataCall (shards lineage rebuilds the loader from it).
    train_args = {"transform": train_spec, "seed": cfg.optim.seed, "return_keys": cfg.run.record_keys,
                  "sampling": sampling, "decode": decode, "remote": remote,
                  "distributed": Distributed(rank, world, nodes=nodes),
                  "mix": MixOptions(cfg.data.class_map, cfg.data.epoch_size)}
    opening = time.perf_counter()
    train_set = shards.open_dataset(specs or cfg.data.path, cfg.data.train_split, cache=train_images, **train_args)
    # Validation reads every selected sample of every source once, whatever the weights.
    val_set = shards.open_dataset(source_specs(cfg, weighted=False) or cfg.data.path, cfg.data.val_split,
                                  transform=eval_spec, seed=cfg.optim.seed, sampling=Sampling(shuffle=False),
                                  decode=decode, remote=remote, cache=val_images, distributed=Distributed(rank, world),
                                  mix=MixOptions(cfg.data.class_map))
    if cfg.data.exclude_keys and not specs:
        exclude_train_keys(cfg, manifest, train_set)
    open_s = time.perf_counter() - opening
    if specs:
        manifest = manifest.replace(splits={cfg.data.train_split: train_set.split_info,
                                            cfg.data.val_split: val_set.split_info})
    train_loader = _loader(train_set, cfg, ctx, drop_last=True, memory=budget.budget)
    val_loader = _loader(val_set, cfg, ctx, drop_last=False, memory=budget.budget)
    if len(train_loader) == 0 and (cfg.model.head != "logreg" or cfg.run.dry_run):  # the probe fits all rows at once
        raise InputError(f"the train split has fewer samples per process than --batch-size {cfg.optim.batch_size}",
                         path=cfg.data.path)
    workers = int(getattr(train_loader, "num_workers", cfg.loader.workers or 0))
    normalize = None
    if kind == "images" and cfg.loader.decode == "fast":
        normalize = val_set.normalizer(channels_last=uses_channels_last(ctx.device.type, kind)).to(ctx.device)
    train_call = DataCall.of(specs or cfg.data.path, cfg.data.train_split, **train_args,
                             loader=LoaderCall(cfg.optim.batch_size, drop_last=True, mode=train_loader.mode))
    return RunData(kind, manifest, train_loader, val_loader, workers, eval_spec, normalize, open_s, train_call,
                   budget.record)


def exclude_train_keys(cfg: TrainConfig, manifest: DatasetManifest | FeatureManifest, train_set: Any) -> None:
    """Leave ``--exclude-keys`` out of the train split's every epoch (the rest keep their order): found over the
    split's column index when it has one, else from the shards' keys."""
    keys = read_keys(cfg.data.exclude_keys)
    columns = None
    if manifest.kind == "images":
        columns = open_columns(locate(cfg.data.path, storage_options=cfg.cache.storage_options), manifest,
                               cfg.data.train_split)
    rows = excluded_rows(keys, columns, train_set)
    train_set.exclude_rows(rows)
    log.info("--exclude-keys: %d of the %d keys listed are in the train split, left out of it", len(rows), len(keys))


def image_caches(cfg: TrainConfig, manifest: DatasetManifest | FeatureManifest,
                 ctx: DistContext) -> tuple[str | MemoryCache, str | MemoryCache]:
    """``open_dataset``'s ``cache`` of the train and val sets: their image caches (``--cache-images``), or
    ``"auto"``.

    One budget per process: ``--memory-limit``, else half of what the job has left shared by the node's ranks
    (they all open their caches at once, each seeing the same free memory). The val crops get what they need, at
    most a quarter (val is read in the same order every epoch, so each rank needs only its share); the train
    images the rest."""
    if not cfg.cache.images:
        return "auto", "auto"
    if manifest.kind != "images":
        raise InputError("--cache-images keeps decoded images; a feature folder is held in memory already",
                         path=cfg.data.path)
    from shards.cache.images import planned_bytes
    from shards.cache.memory_budget import default_memory_limit

    budget = cfg.cache.memory_limit
    if budget is None:
        budget = default_memory_limit() // max(1, ctx.local_world_size)
    world = ctx.world_size if ctx.distributed else 1
    val_samples = -(-manifest.splits[cfg.data.val_split].samples // world)
    val_limit = min(planned_bytes(TransformSpec(preset="eval", size=cfg.loader.image_size), val_samples), budget // 4)
    return MemoryCache(limit=budget - val_limit), MemoryCache(limit=val_limit)


def affinity_nodes(cfg: TrainConfig, manifest: DatasetManifest | FeatureManifest, ctx: DistContext) -> int | None:
    """Keep shards on the same node from epoch to epoch (``shards.order.plan``'s node affinity) exactly when the
    run has several nodes and a node's cache cannot hold the train split: then a global shuffle would make the
    caches miss every epoch; otherwise it costs shuffle quality for nothing."""
    if not cfg.cache.dir or cfg.cache.limit is None or ctx.nodes <= 1:
        return None
    split_bytes = sum(s.bytes for s in manifest.splits[cfg.data.train_split].shards)
    if split_bytes <= cfg.cache.limit:
        return None
    if ctx.is_main:
        log.info("the train split (%s) exceeds --cache-limit (%s): shards keep to their node across epochs "
                 "(node affinity over %d nodes)", human_bytes(split_bytes), human_bytes(cfg.cache.limit), ctx.nodes)
    return ctx.nodes


def loader_mode(dataset: Any, cfg: TrainConfig) -> Any:
    """The run mode ``cfg.loader`` names over ``dataset``, through the one parse (``LoaderOptions.mode_text``,
    ``shards.loader.loader.resolve_mode``): the library's default without settings; ``auto``: ``Auto(workers)``
    (feature rows: in process, nothing to try); otherwise the workers as processes or threads, ``worker_threads``
    decoding beside them."""
    return resolve_mode(dataset, cfg.loader.mode_text())


def _loader(dataset: Any, cfg: TrainConfig, ctx: DistContext, *, drop_last: bool, memory: Any = None) -> Any:
    # DataLoader otherwise draws its worker base seed from the global torch RNG at every ``iter()``, so a resumed
    # run (one extra ``iter()``) would see different dropout than an uninterrupted one. The reader seeds each
    # sample's transform itself, so this generator's values do not matter, only that it is not the global one.
    generator = torch.Generator().manual_seed(cfg.optim.seed)
    mode = loader_mode(dataset, cfg)
    # --stall-timeout (on by default) guards worker processes; a run without any has none to restart.
    stall = StallPolicy(cfg.loader.stall_timeout) if cfg.loader.stall_timeout and mode.on_stall is not None else None
    return shards.make_loader(dataset, batch_size=cfg.optim.batch_size, mode=mode, stall=stall, drop_last=drop_last,
                              pin_memory=ctx.device.type == "cuda" and worth_pinning(dataset, mode),
                              resume_audit=cfg.loader.resume_audit,
                              generator=generator, memory=memory)


def describe_batch(batch: tuple[torch.Tensor, torch.Tensor], classes: list[str]) -> dict[str, Any]:
    """The dry run's report: what the model will actually be fed."""
    inputs, labels = batch[0], batch[1]
    values = inputs.float()
    report = {
        "batch_shape": list(inputs.shape),
        "dtype": str(inputs.dtype).removeprefix("torch."),
        "min": float(values.min()),
        "max": float(values.max()),
        "mean": float(values.mean()),
        "std": float(values.std()) if values.numel() > 1 else 0.0,
        "labels_shape": list(labels.shape),
    }
    if labels.is_floating_point():  # regression targets: their range, not counts per class
        report["target_range"] = [float(labels.min()), float(labels.max())]
        return report
    counts = torch.bincount(labels.long(), minlength=len(classes)).tolist()
    report["label_counts"] = {name: count for name, count in zip(classes, counts) if count}
    return report
