#!/usr/bin/env python
"""Tiny-JPEG ImageFolder corpora for the scale benchmark, made once and kept.

A corpus of N files of ~1.3 kB (64x64 noise, JPEG quality 60) over C classes takes minutes to write at 1.28M files,
so it is written into ``<cache>/tiny-<N>-<C>/`` and a ``.complete`` stamp says it is whole; a killed run leaves no
stamp and the next one starts that corpus again from an empty folder. Files reuse a few hundred distinct encoded
images round-robin: decoding costs the same per file, and generating 1.28M distinct JPEGs would take longer than
packing them. Everything comes from ``--seed``.

    .venv/bin/python scripts/bench/corpus.py --files 200000 --classes 100   # prints the corpus folder
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

DEFAULT_CACHE = Path(os.environ.get("SHARDCACHE_BENCH_CACHE", "/var/tmp/shardcache-bench"))
STAMP = ".complete"
DISTINCT = 256


def tiny_jpegs(count: int, seed: int, size: int = 64) -> list[bytes]:
    """``count`` distinct noisy JPEGs of about 1.3 kB."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(count):
        coarse = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
        pixels = np.repeat(np.repeat(coarse, 8, axis=0), 8, axis=1)
        pixels = np.clip(pixels.astype(np.int16) + rng.integers(-20, 21, pixels.shape), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=60)
        images.append(buffer.getvalue())
    return images


def corpus(files: int, classes: int, seed: int = 0, cache: Path = DEFAULT_CACHE, quiet: bool = False, *,
           kind: str = "tiny", make_images: Callable[[int, int], list[bytes]] = tiny_jpegs) -> Path:
    """The folder of a corpus of ``files`` JPEGs in ``classes`` class folders, written unless present.

    ``make_images(count, seed)`` encodes the distinct images the files repeat (tiny noise by default; the GPU check
    passes photo-sized ones), and ``kind`` names them in the folder's name.
    """
    root = cache / f"{kind}-{files}-{classes}-s{seed}"
    if (root / STAMP).is_file():
        return root
    if root.exists():
        shutil.rmtree(root)
    images = make_images(min(DISTINCT, files), seed)
    names = [f"c{c:04d}" for c in range(classes)]
    for name in names:
        (root / name).mkdir(parents=True)
    total = 0
    for i in range(files):
        data = images[i % len(images)]
        with open(root / names[i % classes] / f"img_{i:08d}.jpg", "wb") as f:
            f.write(data)
        total += len(data)
        if not quiet and i % 100_000 == 0:
            print(f"corpus {root.name}: {i:,}/{files:,} files", file=sys.stderr, flush=True)
    (root / STAMP).write_text(json.dumps({"files": files, "classes": classes, "bytes": total, "seed": seed}))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, required=True)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    print(corpus(args.files, args.classes, args.seed, args.cache))


if __name__ == "__main__":
    main()
