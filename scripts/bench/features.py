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
Progress goes to stderr; the last line on stdout is one JSON object with every number.

    .venv/bin/python scripts/bench/features.py                                   # resnet18, batch 64, 512 images
    .venv/bin/python scripts/bench/features.py --backbone resnet50 --batch-size 256 --images 4096  # on a GPU
"""

from __future__ import annotations

import argparse
import io
import json
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
from preprocess.features.transforms import FeatureTransform, eval_pil, eval_tensors  # noqa: E402
from preprocess.features.featurize import FeatureConfig, run_precompute  # noqa: E402
from shards.devices import resolve_device  # noqa: E402
from shards.image.decode import decode_image  # noqa: E402
from shards.image.device import decode_images  # noqa: E402
from shards.formats.features import load_feature_shard  # noqa: E402
from shards.manifest import DatasetManifest, ShardInfo, SourceInfo, SplitInfo  # noqa: E402
from shards.formats.sample import RawSample  # noqa: E402
from shards.formats.tar import TarShardWriter  # noqa: E402

SPEC = FeatureTransform(256, 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--per-shard", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quick", action="store_true", help="192 images")
    parser.add_argument("--workdir", type=Path, default=None, help="where to build the corpus (default: temp dir)")
    args = parser.parse_args()
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
            "fast_vs_pil_features": compare_features(workdir / "feat-cpu", workdir / "feat-fast"),
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
