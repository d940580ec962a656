"""The demo: real images through every stage (pack, verify, features, train), run as the user would run them.

Each stage is the console script a user would type, so the demo shows the commands and tests them together; every
stage skips what it finds finished, so a rerun reuses the shards, features and run and finishes fast. Human-readable
lines go to stderr; the last line on stdout is one JSON object (``val_top1``, ``data_wait_share``, ``run_dir``...).

The head is the linear probe people compare backbones with (``--head logreg``: scikit-learn's LogisticRegression on
standardised features, fitted full-batch) when the train features fit in memory, else a linear head trained by
AdamW epochs over the streamed features (``--head linear`` asks for that one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(SCRIPTS))

import demo_data  # noqa: E402  (beside this file, not a package)
from shards.manifest import load_dataset_manifest  # noqa: E402

log = logging.getLogger("demo")
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class DemoConfig:
    """Where things go and how to train; ``data=None`` means the ELPV solar cells."""

    data: Path | None
    head: str  # auto, logreg or linear
    val_fraction: float
    seed: int
    epochs: int
    lr: float
    weight_decay: float
    batch_size: int
    max_samples: int
    workers: int
    work: Path
    runs: Path
    quiet: bool

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise SystemExit(f"demo: --val-fraction must be in (0, 1), got {self.val_fraction}")
        if self.data is not None and not self.data.is_dir():
            raise SystemExit(f"demo: --data {self.data}: not a folder")


class StageFailed(RuntimeError):
    pass


def run_stage(name: str, argv: list[str], quiet: bool) -> dict[str, Any]:
    """Run one console script; its progress passes through on stderr, its JSON summary comes back."""
    argv = [str(BIN / argv[0])] + [str(a) for a in argv[1:]] + (["--quiet"] if quiet else [])
    log.info("%s: %s", name, shlex.join([Path(argv[0]).name] + argv[1:]))
    started = time.perf_counter()
    result = subprocess.run(argv, stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode != 0:
        raise StageFailed(f"stage {name} failed (exit {result.returncode}): {shlex.join(argv)}")
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    summary = json.loads(lines[-1]) if lines and lines[-1].lstrip().startswith("{") else {}
    log.info("%s: done in %.1f s", name, time.perf_counter() - started)
    return summary


def prepare_source(cfg: DemoConfig) -> tuple[str, Path, list[str]]:
    """(name, ImageFolder root, extra pack-shards options) for the ELPV tree or the user's own tree."""
    if cfg.data is None:
        tree, built = demo_data.build_elpv_tree(ROOT / "data" / "elpv", val_fraction=cfg.val_fraction, seed=cfg.seed)
        log.info("elpv: %s ImageFolder tree at %s (8 classes, stratified split, seed %d)",
                 "built" if built else "reusing", tree, cfg.seed)
        return f"elpv-val{cfg.val_fraction:g}-seed{cfg.seed}", tree, []
    root = cfg.data.resolve()
    name = f"{root.name}-{hashlib.sha256(str(root).encode()).hexdigest()[:8]}"
    if (root / "train").is_dir() and (root / "val").is_dir():
        return name, root, []
    split_options = ["--val-fraction", cfg.val_fraction, "--seed", cfg.seed]
    return f"{name}-val{cfg.val_fraction:g}-seed{cfg.seed}", root, split_options


def choose_head(cfg: DemoConfig, feat_dir: Path) -> str:
    """``--head auto``: the probe when its estimate of the train features in memory fits half of what is free."""
    if cfg.head != "auto":
        return cfg.head
    import torch
    from shards.cache.memory_budget import default_memory_limit
    from shards.manifest import load_feature_manifest
    from train.model.probe import probe_bytes

    manifest = load_feature_manifest(feat_dir)
    itemsize = torch.empty(0, dtype=getattr(torch, manifest.dtype, torch.float32)).element_size()
    needed = probe_bytes(manifest.split("train").samples, manifest.features_dim, len(manifest.classes), itemsize)
    head = "logreg" if needed <= default_memory_limit() else "linear"
    log.info("head: %s (the train features need about %.1f MB in memory)", head, needed / 1e6)
    return head


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise StageFailed(f"{path}: missing after training")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_pipeline(cfg: DemoConfig) -> dict[str, Any]:
    started = time.perf_counter()
    weights = demo_data.mobilenet_weights_file()
    demo_data.verify_weights(weights)
    log.info("weights: %s (sha256 verified: torchvision MobileNet_V2 IMAGENET1K_V1)", weights)
    name, source, pack_extra = prepare_source(cfg)
    # Options are in the folder names: changing one builds beside the old artifacts instead of refusing.
    shards_dir = cfg.work / name / f"shards-max{cfg.max_samples}"
    feat_dir = shards_dir.with_name(shards_dir.name + "-features-mobilenet_v2")
    run_stage("pack", ["pack-shards", source, "--out", shards_dir, "--shard-samples", cfg.max_samples,
                       "--workers", cfg.workers, *pack_extra], cfg.quiet)
    # A small tree of your own may hold fewer training samples than one batch.
    batch_size = min(cfg.batch_size, load_dataset_manifest(shards_dir).split("train").samples)
    run_stage("verify", ["shards", "verify", shards_dir], cfg.quiet)
    run_stage("features", ["precompute-features", shards_dir, "--out", feat_dir, "--backbone", "mobilenet_v2",
                           "--weights", weights], cfg.quiet)
    head = choose_head(cfg, feat_dir)
    if head == "logreg":
        run_dir = cfg.runs / f"demo-{name}-logreg-seed{cfg.seed}"
        options = ["--head", "logreg", "--batch-size", batch_size]
    else:
        run_dir = cfg.runs / (f"demo-{name}-linear-e{cfg.epochs}-lr{cfg.lr:g}-wd{cfg.weight_decay:g}"
                              f"-b{batch_size}")
        options = ["--head", "linear", "--epochs", cfg.epochs, "--optimizer", "adamw", "--lr", cfg.lr,
                   "--weight-decay", cfg.weight_decay, "--batch-size", batch_size]
    train = run_stage("train", ["train-from-shards", feat_dir, "--out", run_dir, *options, "--seed", cfg.seed,
                                "--resume"], cfg.quiet)
    history = read_metrics(run_dir)
    for row in history:
        print(f"epoch {row['epoch']:>3}  val top-1 {row['val_top1']:.3f}  train loss {row['train_loss']:.3f}  "
              f"data wait {row['data_wait_share']:.1%}", file=sys.stderr)
    wait = train.get("data_wait_share")
    if wait is None:
        wait = sum(row["data_wait_share"] for row in history) / len(history)
    result = {
        "dataset": "elpv" if cfg.data is None else str(cfg.data),
        "head": head,
        "val_top1": history[-1]["val_top1"],
        "best_val_top1": max(row["val_top1"] for row in history),
        "epochs": len(history),
        "logreg_c": history[-1]["probe"]["C"] if head == "logreg" else None,
        "data_wait_share": wait,
        "source": str(source),
        "shards_dir": str(shards_dir),
        "features_dir": str(feat_dir),
        "run_dir": str(run_dir),
        "model": str(run_dir / "model.pt"),
        "seconds": round(time.perf_counter() - started, 1),
    }
    for key in ("source", "shards_dir", "features_dir", "run_dir", "model"):
        print(f"{key:>13}: {result[key]}", file=sys.stderr)
    print(f"val top-1 {result['val_top1']:.3f} (best {result['best_val_top1']:.3f}), data-wait share "
          f"{wait:.1%}, {result['seconds']} s", file=sys.stderr)
    return result


def parse_args(argv: list[str] | None = None) -> DemoConfig:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=None,
                        help="your own ImageFolder tree (root/<class>/... or root/{train,val}/<class>/...); "
                             "default: the ELPV solar cells")
    parser.add_argument("--head", choices=("auto", "logreg", "linear"), default="auto",
                        help="auto: the full-batch logistic-regression probe when the train features fit in memory, "
                             "else the linear head trained for --epochs")
    parser.add_argument("--val-fraction", type=float, default=0.2, help="held-out share when there is no val/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=40, help="--head linear: epochs")
    parser.add_argument("--lr", type=float, default=0.01, help="--head linear: AdamW peak learning rate (cosine decay)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="--head linear: AdamW weight decay")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shard-samples", type=int, default=256, help="samples per shard")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="packing processes")
    parser.add_argument("--work", type=Path, default=ROOT / ".demo", help="shards and features go here")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs", help="the training run goes here")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    return DemoConfig(data=args.data, head=args.head, val_fraction=args.val_fraction, seed=args.seed,
                      epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay, batch_size=args.batch_size,
                      max_samples=args.shard_samples, workers=args.workers, work=args.work.resolve(),
                      runs=args.runs.resolve(), quiet=args.quiet)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=logging.WARNING if cfg.quiet else logging.INFO, stream=sys.stderr,
                        format="demo: %(message)s")
    try:
        result = run_pipeline(cfg)
    except (StageFailed, demo_data.DemoInputError) as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
