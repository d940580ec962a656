"""Benchmark ``train-from-shards``: samples/s and data-wait share, features vs a per-sample loader vs images.

In one run, on generated data:
1. a linear head on N x D float16 feature shards (default 200,000 x 2048, 100 classes) through the in-process
   batched feature path, for a few epochs (the promise: data-wait share under 5%), with and without the
   background-thread prefetch of the next batches;
2. the same head for one epoch through a per-sample DataLoader with one worker (what a plain loader does), on a
   smaller cache of the same width (it is that slow);
3. a short image-model run (resnet18 at small size) from JPEG tar shards.
Progress and the table go to stderr; the last line on stdout is one JSON object.

    python scripts/bench/train.py [--samples 200000 --dim 2048 --epochs 3 --work-dir /tmp/bench-train]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# This file is named train.py, and Python puts its folder first on sys.path, where it would shadow the ``train``
# package; drop that entry before importing it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import numpy as np
import torch
from PIL import Image

from shards.formats.features import FeatureShard, feature_shard_name, write_feature_shard
from shards.transport.manifest_io import dataset_sha256_at
from shards.manifest import DatasetManifest, FeatureManifest, ShardInfo, SplitInfo
from shards.provenance import SourceInfo
from shards.jobs.progress import setup_logging
from shards.formats.sample import RawSample
from shards.transport.storage import get_storage, shard_name
from train.config import TrainConfig
from train.run.loop import train
from shards.runrecord import read_rows

log = logging.getLogger("bench.train")


def write_features(root: Path, samples: int, dim: int, classes: int, shard_rows: int, seed: int) -> Path:
    """Class means plus noise, float16, ``shard_rows`` per shard; val is 5% of train."""
    dataset_dir, features_dir = root / "dataset", root / "features"
    dataset_dir.mkdir(parents=True, exist_ok=True)
    features_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    means = torch.randn(classes, dim, generator=generator)
    names = [f"c{i:03d}" for i in range(classes)]
    image_splits, feature_splits = {}, {}
    for split, total in (("train", samples), ("val", max(classes, samples // 20))):
        image_shards, feature_shards, counts = [], [], [0] * classes
        for index, start in enumerate(range(0, total, shard_rows)):
            size = min(shard_rows, total - start)
            labels = torch.randint(0, classes, (size,), generator=generator)
            rows = (means[labels] + 8.0 * torch.randn(size, dim, generator=generator)).half()
            name = shard_name(split, index, "tar")
            target = features_dir / feature_shard_name(name, "pt")
            keys = [f"{split}_{start + i:07d}" for i in range(size)]
            nbytes, digest = write_feature_shard(target, FeatureShard(rows, labels, keys), "pt")
            for label, count in zip(*np.unique(labels.numpy(), return_counts=True)):
                counts[int(label)] += int(count)
            image_shards.append(ShardInfo(name, size, 0, "0" * 64))
            feature_shards.append(ShardInfo(target.name, size, nbytes, digest, source=name))
        image_splits[split] = SplitInfo(total, tuple(counts), tuple(image_shards))
        feature_splits[split] = SplitInfo(total, tuple(counts), tuple(feature_shards))
    DatasetManifest(storage="tar", classes=tuple(names), splits=image_splits,
                    source=SourceInfo("generated", "", 0), packing={"seed": seed}).save(dataset_dir)
    FeatureManifest(storage="pt", classes=tuple(names), splits=feature_splits, features_dim=dim, dtype="float16",
                    views=0, config={"backbone": "generated"}, config_hash="bench", dataset_dir=str(dataset_dir),
                    dataset_sha256=dataset_sha256_at(dataset_dir)).save(features_dir)
    return features_dir


def write_images(root: Path, samples: int, side: int, classes: int, shard_size: int, seed: int) -> Path:
    """Noisy class-coloured JPEGs of ``side`` px in tar shards."""
    rng = np.random.default_rng(seed)
    palette = rng.integers(30, 225, size=(classes, 3))
    writer_type = get_storage("tar").writer
    names = [f"c{i}" for i in range(classes)]
    splits = {}
    for split, total in (("train", samples), ("val", max(classes, samples // 8))):
        shards, counts, n = [], [0] * classes, 0
        for index, start in enumerate(range(0, total, shard_size)):
            name = shard_name(split, index, "tar")
            with writer_type(root / name, classes=names) as writer:
                for _ in range(min(shard_size, total - start)):
                    label = n % classes
                    pixels = np.clip(palette[label] + rng.normal(0, 40, (side, side, 3)), 0, 255).astype(np.uint8)
                    buffer = io.BytesIO()
                    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
                    writer.write(RawSample(f"{split}_{n:06d}", buffer.getvalue(), "jpg", label, b"{}"))
                    counts[label] += 1
                    n += 1
            shards.append(ShardInfo(name, writer.samples, writer.bytes, writer.sha256))
        splits[split] = SplitInfo(n, tuple(counts), tuple(shards))
    DatasetManifest(storage="tar", classes=tuple(names), splits=splits, source=SourceInfo("generated", "", samples),
                    packing={"seed": seed}).save(root)
    return root


def measure(name: str, cfg: TrainConfig) -> dict:
    """Train, then read throughput and data-wait share per epoch from metrics.jsonl."""
    started = time.perf_counter()
    summary = train(cfg)
    rows = [row.to_json() for row in read_rows(Path(cfg.run.out_dir) / "metrics.jsonl")]
    steady = rows[1:] or rows  # the first epoch also pays for loading the cache into memory
    result = {
        "samples_per_s": float(np.mean([r["samples_per_s"] for r in steady])),
        "data_wait_share": float(np.mean([r["data_wait_share"] for r in steady])),
        "first_epoch_samples_per_s": rows[0]["samples_per_s"],
        "first_epoch_data_wait_share": rows[0]["data_wait_share"],
        "val_top1": summary["val_top1"],
        "epochs": len(rows),
        "wall_s": time.perf_counter() - started,
    }
    log.info("%-34s %10.0f samples/s  data wait %5.1f%%  (first epoch %.0f/s, %.1f%%)  val_top1 %.3f",
             name, result["samples_per_s"], 100 * result["data_wait_share"], result["first_epoch_samples_per_s"],
             100 * result["first_epoch_data_wait_share"], result["val_top1"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--per-sample-samples", type=int, default=20_000,
                        help="Size of the (separate, smaller) cache the slow per-sample DataLoader epoch reads.")
    parser.add_argument("--image-samples", type=int, default=256)
    parser.add_argument("--image-side", type=int, default=160, help="Stored JPEG size (the crop is --image-size).")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--image-model", default="resnet18")
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers for the image run.")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice; 1 is faster on a busy shared CPU).")
    parser.add_argument("--work-dir", type=Path, default=None, help="Default: a temporary folder, removed after.")
    args = parser.parse_args()
    setup_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-train-"))
    try:
        results = run(args, work)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(results, sort_keys=True))


def run(args: argparse.Namespace, work: Path) -> dict:
    started = time.perf_counter()
    features = write_features(work / "cache", args.samples, args.dim, args.classes, 10_000, seed=0)
    log.info("wrote %d x %d float16 features in %.1fs", args.samples, args.dim, time.perf_counter() - started)
    small = write_features(work / "cache-small", min(args.per_sample_samples, args.samples), args.dim, args.classes,
                           10_000, seed=1)
    images = write_images(work / "images", args.image_samples, args.image_side, 4, 128, seed=0)
    common = {"run.device": args.device, "run.quiet": True, "run.overwrite": True, "optim.seed": 0}
    batched = measure("features, in-process batches", TrainConfig.of(
        str(features), str(work / "run-features"),
        {"optim.epochs": args.epochs, "optim.batch_size": args.batch_size, **common}))
    unprefetched = measure("features, in-process, no prefetch", TrainConfig.of(
        str(features), str(work / "run-features-no-prefetch"),
        {"optim.epochs": 2, "optim.batch_size": args.batch_size, "loader.prefetch": 0, **common}))
    per_sample = measure("features, per-sample DataLoader (1 worker)", TrainConfig.of(
        str(small), str(work / "run-features-dataloader"),
        {"optim.epochs": 1, "optim.batch_size": args.batch_size, "loader.workers": 1, **common}))
    image = measure(f"images, {args.image_model} @ {args.image_size}px ({args.workers} worker)", TrainConfig.of(
        str(images), str(work / "run-images"),
        {"model.name": args.image_model, "loader.image_size": args.image_size, "optim.epochs": 2,
         "optim.batch_size": 32, "optim.optimizer": "adamw", "loader.workers": args.workers, **common}))
    ratio = batched["samples_per_s"] / per_sample["first_epoch_samples_per_s"]
    prefetch_ratio = batched["samples_per_s"] / unprefetched["samples_per_s"]
    log.info("in-process feature batches are %.1fx the per-sample DataLoader; data wait %.1f%% vs %.1f%%", ratio,
             100 * batched["data_wait_share"], 100 * per_sample["first_epoch_data_wait_share"])
    log.info("prefetch thread: %.2fx samples/s of no prefetch; data wait %.1f%% vs %.1f%%", prefetch_ratio,
             100 * batched["data_wait_share"], 100 * unprefetched["data_wait_share"])
    return {
        "bench": "train", "features_shape": [args.samples, args.dim], "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "features": batched, "features_no_prefetch": unprefetched, "features_per_sample_loader": per_sample,
        "images": image,
        "features_speedup_vs_per_sample_loader": ratio, "features_speedup_of_prefetch": prefetch_ratio,
        "features_data_wait_target_met": batched["data_wait_share"] < 0.05,
    }


if __name__ == "__main__":
    sys.exit(main())
