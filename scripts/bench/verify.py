#!/usr/bin/env python
"""Benchmark ``shards verify --workers N``: one worker against N, side by side in one run, on the same dataset.

Writes a dataset of small JPEGs (default 40 shards x 250 samples of 64x64, ~2 kB each, with the tar sidecar index
recorded as pack-shards records it), then times ``verify_dataset`` with 1 worker and with ``--workers`` (default 2)
alternately, ``--repeats`` times each, and prints the best time of each and the ratio. Default checks (4 images
decoded per shard) unless ``--full``. The page cache is warm for both (the dataset was just written), so this
measures the checks' CPU cost, which is what workers divide. Progress goes to stderr; the last line on stdout is
one JSON object with every number.

    .venv/bin/python scripts/bench/verify.py                 # 40 x 250, 1 vs 2 workers
    .venv/bin/python scripts/bench/verify.py --shards 8 --samples 100 --repeats 1   # a quick look
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shards.check.verify import verify_dataset  # noqa: E402
from shards.formats.sample import RawSample  # noqa: E402
from shards.transport.storage import get_storage, shard_name  # noqa: E402
from shards.manifest import DatasetManifest, ShardInfo, SplitInfo  # noqa: E402
from shards.provenance import SourceInfo  # noqa: E402
from shards.jobs.parallel import usable_cpus  # noqa: E402

CLASSES = tuple(f"class_{i:02d}" for i in range(10))


def small_jpegs(count: int, seed: int, size: int = 64) -> list[bytes]:
    """``count`` distinct noisy JPEGs (reused round-robin: decoding cost is per sample, not per distinct image)."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(count):
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=60)
        images.append(buffer.getvalue())
    return images


def write_dataset(out: Path, shards: int, samples: int, seed: int) -> int:
    """A one-split dataset written with the tar writer; returns its bytes."""
    images = small_jpegs(64, seed)
    writer_type = get_storage("tar").writer
    infos, counts, n, total = [], [0] * len(CLASSES), 0, 0
    for index in range(shards):
        name = shard_name("train", index, "tar")
        own = [0] * len(CLASSES)
        with writer_type(out / name, classes=CLASSES) as writer:
            for _ in range(samples):
                label = n % len(CLASSES)
                writer.write(RawSample(f"train_{n:08d}", images[n % len(images)], "jpg", label, b"{}"))
                own[label] += 1
                n += 1
        counts = [a + b for a, b in zip(counts, own)]
        total += writer.bytes
        infos.append(ShardInfo(name, writer.samples, writer.bytes, writer.sha256, index=writer.index,
                               index_sha256=writer.index_sha256, class_counts=tuple(own)))
    DatasetManifest(storage="tar", classes=CLASSES, splits={"train": SplitInfo(n, tuple(counts), tuple(infos))},
                    source=SourceInfo(kind="generated", root="", files_seen=n), packing={"seed": seed}).save(out)
    return total


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the pool's workers, once it is shut down)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(folder: Path, workers: int, full: bool) -> tuple[float, float]:
    """Wall and CPU seconds of one verify (CPU over wall near ``workers`` on an idle machine: the work divides)."""
    start, cpu = time.perf_counter(), cpu_seconds()
    report = verify_dataset(folder, full=full, workers=workers, quiet=True)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    if not report.ok:
        raise SystemExit(f"verify found problems in a fresh dataset: {report.problems[:3]}")
    print(f"  {workers} worker(s): {seconds:.2f} s wall, {cpu:.2f} s CPU", file=sys.stderr)
    return seconds, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument("--samples", type=int, default=250, help="samples per shard")
    parser.add_argument("--workers", type=int, default=2, help="compared with 1 worker")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; the best counts")
    parser.add_argument("--full", action="store_true", help="decode every image")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="where to write the dataset (default: temp)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="shardcache-bench-", dir=args.workdir))
    try:
        folder = workdir / "data"
        folder.mkdir()
        nbytes = write_dataset(folder, args.shards, args.samples, args.seed)
        print(f"dataset: {args.shards} shards x {args.samples} samples, {nbytes / 1e6:.1f} MB", file=sys.stderr)
        one, many = [], []
        for _ in range(args.repeats):
            one.append(timed(folder, 1, args.full))
            many.append(timed(folder, args.workers, args.full))
        (one_s, one_cpu), (many_s, many_cpu) = min(one), min(many)
        result = {"shards": args.shards, "samples_per_shard": args.samples, "mb": round(nbytes / 1e6, 1),
                  "full": args.full, "workers": args.workers, "cpus": usable_cpus(), "one_worker_s": round(one_s, 3),
                  "one_worker_cpu_s": round(one_cpu, 3), "n_workers_s": round(many_s, 3),
                  "n_workers_cpu_s": round(many_cpu, 3), "speedup": round(one_s / many_s, 2)}
        print(f"verify: 1 worker {one_s:.2f} s ({one_cpu:.2f} s CPU), {args.workers} workers {many_s:.2f} s "
              f"({many_cpu:.2f} s CPU): {result['speedup']:.2f}x (a busy machine lowers it: compare the load "
              f"average with the CPUs)", file=sys.stderr)
        print(json.dumps(result))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
