#!/usr/bin/env python
"""Benchmark pack-shards against the raw-copy bound: ``tar -cf`` over the same files, in the same run.

Generates an ImageNet-like corpus (~500x375 JPEGs of smooth shapes plus grain, ~10 classes), times ``tar -cf``,
then packs it with ``--verify header`` and ``--verify full`` and prints files/s, MB/s and the ratio to tar. The page
cache is warm for every contender (the corpus was just written), so this measures CPU cost, not the disk.
Progress goes to stderr; the last line on stdout is one JSON object with every number.

    .venv/bin/python scripts/bench/pack.py            # 3000 files
    .venv/bin/python scripts/bench/pack.py --quick    # 400 files
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from preprocess.pack.packer import PackConfig, pack  # noqa: E402


def make_image(rng: np.random.Generator, width: int = 500, height: int = 375) -> bytes:
    """Low-frequency colour fields plus fine grain: compresses like a photo (~40-120 kB at quality 90)."""
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.normal(0, 18, (height, width, 3))
    pixels = np.clip(base + grain, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def make_corpus(root: Path, files: int, classes: int, seed: int) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    total = 0
    for i in range(files):
        folder = root / f"class_{i % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        data = make_image(rng)
        (folder / f"n{i:07d}.JPEG").write_bytes(data)
        total += len(data)
    return files, total


def timed(label: str, func) -> float:
    start = time.perf_counter()
    func()
    seconds = time.perf_counter() - start
    print(f"  {label}: {seconds:.2f} s", file=sys.stderr)
    return seconds


def row(name: str, files: int, nbytes: int, seconds: float, tar_seconds: float) -> dict:
    return {"name": name, "seconds": round(seconds, 3), "files_per_s": round(files / seconds, 1),
            "mb_per_s": round(nbytes / seconds / 1e6, 1), "time_vs_tar": round(seconds / tar_seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="400 files instead of 3000")
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None, help="where to build the corpus (default: a temp dir)")
    args = parser.parse_args()
    files = args.files or (400 if args.quick else 3000)
    workdir = Path(tempfile.mkdtemp(prefix="shardcache-bench-", dir=args.workdir))
    try:
        source = workdir / "src"
        print(f"generating {files} JPEGs in {source}", file=sys.stderr)
        files, nbytes = make_corpus(source, files, classes=10, seed=0)
        print(f"corpus: {files} files, {nbytes / 1e6:.1f} MB", file=sys.stderr)
        results = []
        tar_s = timed("tar -cf", lambda: subprocess.run(["tar", "-cf", str(workdir / "copy.tar"), "-C", str(source),
                                                         "."], check=True))
        results.append(row("tar -cf", files, nbytes, tar_s, tar_s))
        for verify in ("header", "full"):
            cfg = PackConfig(str(source), str(workdir / f"out-{verify}"), verify=verify, workers=args.workers,
                             quiet=True)
            seconds = timed(f"pack-shards --verify {verify} --workers {args.workers}", lambda: pack(cfg))
            results.append(row(f"pack-shards --verify {verify}", files, nbytes, seconds, tar_s))
        print(f"{'':34}{'files/s':>10}{'MB/s':>10}{'time vs tar':>14}")
        for r in results:
            print(f"{r['name']:34}{r['files_per_s']:>10}{r['mb_per_s']:>10}{r['time_vs_tar']:>13}x")
        print(json.dumps({"bench": "pack", "files": files, "bytes": nbytes, "workers": args.workers,
                          "results": results}, sort_keys=True))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
