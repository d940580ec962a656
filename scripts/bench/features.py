#!/usr/bin/env python
"""Benchmark precompute-features against the model's own forward rate, in the same run.

Writes ImageNet-like JPEGs (~500x375) into tar shards, then measures on this machine's device:
  model forward  : the backbone on in-memory float tensors [batch, 3, 224, 224] (the ceiling);
  precompute fast    : precompute-features' default (DCT-scaled decode, one crop-then-resize to uint8 in workers);
  precompute standard: precompute-features --decode standard (PIL decode + torchvision transform in workers);
  precompute device  : precompute-features --decode device (batched decode_jpeg + resize/crop on the model's
                       device; on a CPU-only machine that device is the CPU, in the main process).
The ratio precompute/model shows whether feeding or the model is the limit. The two decode paths' features are
compared (max abs diff, min cosine) and so are their uint8 model inputs (mean abs difference in gray levels).

``--mode first-epoch`` measures the other end, training on a feature cache: it writes ``--rows`` x ``--dim`` fp16
feature shards, then, side by side in one run, trains a linear head for two epochs through the in-process loader
with the whole permutation (``feature_window=0``) and with a windowed order (``--window`` rows), each starting
cold (``cache="memory"`` loads on first use, and the shard files are dropped from the page cache with
``posix_fadvise(DONTNEED)`` first). Per epoch: seconds, and the share of them the loader's ``read`` stage took
(the training step waiting for data), seconds and share.
Progress goes to stderr; the last line on stdout is one JSON object with every number.

    .venv/bin/python scripts/bench/features.py                                   # resnet18, batch 64, 512 images
    .venv/bin/python scripts/bench/features.py --backbone resnet50 --batch-size 256 --images 4096  # on a GPU
    .venv/bin/python scripts/bench/features.py --mode first-epoch --rows 200000 --dim 2048 --workdir /var/tmp/me
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from preprocess.features.backbones import build_backbone  # noqa: E402
from preprocess.features.transforms import eval_pil, eval_tensors  # noqa: E402
from shards.image.transforms import TransformSpec  # noqa: E402
from preprocess.features.featurize import FeatureConfig, run_precompute  # noqa: E402
from shards.jobs.devices import resolve_device  # noqa: E402
from shards.image.decode import decode_image  # noqa: E402
from shards.image.device import decode_images  # noqa: E402
import shards  # noqa: E402
from shards.formats.features import (  # noqa: E402
    FeatureShard, feature_shard_name, load_feature_shard, write_feature_shard,
)
from shards.manifest import DatasetManifest, FeatureManifest, ShardInfo, SplitInfo  # noqa: E402
from shards.provenance import SourceInfo  # noqa: E402
from shards.formats.sample import RawSample  # noqa: E402
from shards.formats.tar import TarShardWriter  # noqa: E402

SPEC = TransformSpec(preset="eval", size=224, resize_size=256, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


DECODES = ("fast", "standard", "device")

def make_image(rng: np.random.Generator, width: int = 500, height: int = 375) -> bytes:
    """Low-frequency colour fields plus grain: compresses like a photo (~40-120 kB at quality 90)."""
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    pixels = np.clip(base + rng.normal(0, 18, (height, width, 3)), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def make_dataset(out: Path, images: int, per_shard: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    datas = [make_image(rng) for _ in range(images)]
    shards = []
    for index, start in enumerate(range(0, images, per_shard)):
        name = f"train-{index:06d}.tar"
        with TarShardWriter(out / name, classes=["a", "b"]) as writer:
            for i in range(start, min(images, start + per_shard)):
                writer.write(RawSample(f"img{i:07d}", datas[i], "jpg", i % 2, b"{}"))
        shards.append(ShardInfo(name, writer.samples, writer.bytes, writer.sha256))
    counts = (sum(1 - i % 2 for i in range(images)), sum(i % 2 for i in range(images)))
    DatasetManifest("tar", ("a", "b"), {"train": SplitInfo(images, counts, tuple(shards))},
                    SourceInfo("generated", "", images), {"seed": 0}).save(out)
    return datas


def model_rate(backbone: str, batch_size: int, device: torch.device, amp: str, repeats: int) -> float:
    model = build_backbone(backbone).model.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    batch = torch.randn(batch_size, 3, 224, 224, device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)

    def forward() -> None:
        with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            model(batch).float().cpu()

    forward()  # warm-up: kernel selection, allocator
    start = time.perf_counter()
    for _ in range(repeats):
        forward()
    return batch_size * repeats / (time.perf_counter() - start)


def decode_difference(datas: list[bytes], device: torch.device) -> float:
    """Mean abs difference (gray levels) between the PIL path's and the device path's uint8 model inputs."""
    sample = datas[:32]
    pil = torch.stack([eval_pil(decode_image(d), SPEC) for d in sample])
    dev = eval_tensors(decode_images(sample, ["jpg"] * len(sample), [1] * len(sample), device), SPEC).cpu()
    return float((pil.float() - dev.float()).abs().mean())


def compare_features(a_dir: Path, b_dir: Path) -> dict[str, float]:
    worst, cosine = 0.0, 1.0
    for path in sorted(a_dir.glob("*.pt")):
        a, b = load_feature_shard(path).features.float(), load_feature_shard(b_dir / path.name).features.float()
        worst = max(worst, float((a - b).abs().max()))
        cosine = min(cosine, float(torch.nn.functional.cosine_similarity(a, b).min()))
    return {"max_abs_diff": round(worst, 5), "min_cosine": round(cosine, 6)}


def make_feature_cache(out: Path, rows: int, dim: int, per_shard: int, classes: int) -> None:
    """``rows`` x ``dim`` fp16 feature shards of ``per_shard`` rows each, and their ``features.json``."""
    out.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    infos, counts = [], [0] * classes
    for index, start in enumerate(range(0, rows, per_shard)):
        count = min(per_shard, rows - start)
        labels = torch.randint(0, classes, (count,), generator=generator)
        features = torch.randn(count, dim, generator=generator).to(torch.float16)
        keys = [f"s{i:08d}" for i in range(start, start + count)]
        name = feature_shard_name(f"train-{index:06d}.tar", "pt")
        nbytes, digest = write_feature_shard(out / name, FeatureShard(features, labels, keys), "pt")
        infos.append(ShardInfo(name, count, nbytes, digest))
        for label, n in zip(*np.unique(labels.numpy(), return_counts=True)):
            counts[int(label)] += int(n)
    FeatureManifest("pt", tuple(f"c{i}" for i in range(classes)), {"train": SplitInfo(rows, tuple(counts),
                    tuple(infos))}, dim, "float16", 0, {"backbone": "bench"}, "0" * 16, "", "0" * 64).save(out)


def drop_page_cache(folder: Path) -> None:
    """Evict the shard files from the page cache (written back first, so the pages are clean and can go)."""
    for path in folder.glob("*.pt"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def train_epochs(folder: Path, window: int, batch_size: int, classes: int, epochs: int) -> list[dict[str, float]]:
    """Train a linear head for ``epochs`` epochs from a cold start; seconds and loader wait share per epoch."""
    drop_page_cache(folder)
    dataset = shards.open_dataset(folder, "train", seed=0, cache="memory",
                                  sampling=shards.Sampling(feature_window=window))
    loader = shards.make_loader(dataset, batch_size)
    head = torch.nn.Linear(dataset.features_dim, classes)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.01)
    results = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        loader.reset_stage_seconds()
        start = time.perf_counter()
        for features, labels in loader:
            loss = torch.nn.functional.cross_entropy(head(features.float()), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        seconds = time.perf_counter() - start
        waited = loader.stage_seconds()["read"]
        results.append({"epoch": epoch + 1, "seconds": round(seconds, 2), "waited_s": round(waited, 2),
                        "waited_share": round(waited / seconds, 4)})
        print(f"feature_window={window} epoch {epoch + 1}: {seconds:.1f} s, waited {waited / seconds:.1%}",
              file=sys.stderr)
    return results


def first_epoch_bench(args: argparse.Namespace) -> None:
    window = args.window or 4 * args.per_shard
    torch.set_num_threads(args.threads)  # one training thread: OpenMP threads on a shared machine stall each other
    workdir = Path(tempfile.mkdtemp(prefix="shardcache-bench-first-epoch-", dir=args.workdir))
    try:
        print(f"writing {args.rows} x {args.dim} fp16 features in {workdir}", file=sys.stderr)
        make_feature_cache(workdir / "features", args.rows, args.dim, args.per_shard, args.classes)
        runs = {w: train_epochs(workdir / "features", w, args.batch_size, args.classes, 2) for w in (0, window)}
        print(f"{'feature_window':>16}{'epoch':>7}{'seconds':>9}{'waited s':>10}{'waited':>9}")
        for w, epochs in runs.items():
            for e in epochs:
                print(f"{w:>16}{e['epoch']:>7}{e['seconds']:>9.1f}{e['waited_s']:>10.2f}{e['waited_share']:>9.1%}")
        print(json.dumps({"bench": "features-first-epoch", "rows": args.rows, "dim": args.dim, "dtype": "float16",
                          "per_shard": args.per_shard, "batch_size": args.batch_size, "classes": args.classes,
                          "window": window, "torch_threads": torch.get_num_threads(), "load": os.getloadavg(),
                          "whole": runs[0], "windowed": runs[window]}, sort_keys=True))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("precompute", "first-epoch"), default="precompute")
    parser.add_argument("--rows", type=int, default=200_000, help="first-epoch: feature rows")
    parser.add_argument("--dim", type=int, default=2048, help="first-epoch: feature width")
    parser.add_argument("--classes", type=int, default=100, help="first-epoch: the linear head's classes")
    parser.add_argument("--window", type=int, default=0, help="first-epoch: feature_window (0: 4 shards' rows)")
    parser.add_argument("--threads", type=int, default=1, help="first-epoch: torch threads of the training step")
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=None, help="default 64 (first-epoch: 1024)")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--per-shard", type=int, default=None, help="default 128 (first-epoch: 5000)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quick", action="store_true", help="192 images")
    parser.add_argument("--workdir", type=Path, default=None, help="where to build the corpus (default: temp dir)")
    args = parser.parse_args()
    first_epoch = args.mode == "first-epoch"
    args.batch_size = args.batch_size or (1024 if first_epoch else 64)
    args.per_shard = args.per_shard or (5000 if first_epoch else 128)
    if first_epoch:
        first_epoch_bench(args)
        return
    images = 192 if args.quick else args.images
    device = resolve_device(args.device)
    amp = "bf16" if device.type == "cuda" else "off"
    workdir = Path(tempfile.mkdtemp(prefix="shardcache-bench-features-", dir=args.workdir))
    try:
        print(f"generating {images} JPEGs in {workdir}", file=sys.stderr)
        datas = make_dataset(workdir / "data", images, args.per_shard)
        repeats = max(2, min(20, images // args.batch_size))
        forward = model_rate(args.backbone, args.batch_size, device, amp, repeats)
        print(f"model forward: {forward:.1f} img/s", file=sys.stderr)
        runs = {}
        for decode in DECODES:
            cfg = FeatureConfig(workdir / "data", workdir / f"feat-{decode}", backbone=args.backbone,
                                weights="none", resize=256, crop=224, batch_size=args.batch_size,
                                workers=args.workers, device=args.device, decode=decode, quiet=True)
            runs[decode] = run_precompute(cfg)[1]
            print(f"precompute --decode {decode}: {runs[decode]['images_per_s']} img/s, "
                  f"data wait {runs[decode]['data_wait_share']:.0%}", file=sys.stderr)
        result = {
            "bench": "features", "backbone": args.backbone, "batch_size": args.batch_size, "images": images,
            "workers": args.workers, "device": str(device), "amp": amp, "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "model_forward_images_per_s": round(forward, 1),
            "precompute_images_per_s": runs["fast"]["images_per_s"],
            "precompute_vs_model": round(runs["fast"]["images_per_s"] / forward, 3),
            "data_wait_share": runs["fast"]["data_wait_share"],
            "precompute_pil_images_per_s": runs["standard"]["images_per_s"],
            "pil_decode_vs_model": round(runs["standard"]["images_per_s"] / forward, 3),
            "fast_vs_pil_features": compare_features(workdir / "feat-standard", workdir / "feat-fast"),
            "precompute_gpu_decode_images_per_s": runs["device"]["images_per_s"],
            "gpu_decode_vs_model": round(runs["device"]["images_per_s"] / forward, 3),
            "gpu_decode_data_wait_share": runs["device"]["data_wait_share"],
            "decode_paths_input_mean_abs_gray_levels": round(decode_difference(datas, device), 4),
            "decode_paths_features": compare_features(workdir / "feat-standard", workdir / "feat-device"),
        }
        print(f"{'':28}{'img/s':>10}{'vs model':>10}")
        print(f"{'model forward':28}{forward:>10.1f}{1:>10.2f}")
        for decode in DECODES:
            rate = runs[decode]["images_per_s"]
            print(f"{'precompute --decode ' + decode:28}{rate:>10.1f}{rate / forward:>10.2f}")
        print(json.dumps(result, sort_keys=True))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
