#!/usr/bin/env python
"""Benchmark: what feeding a model costs the training process's main thread, per image, in each run mode; and where
``precompute-features``'s consumer loop spends its time, stage by stage, with a model that costs nothing.

A GPU at 20k img/s leaves the main thread 50 us per image for everything it does; what the loader takes of that
(receiving a batch from worker processes, taking one a thread filled) is time the step cannot use. So the first
part measures the main thread's CPU time (``time.thread_time``, not wall: waiting for a batch costs no CPU) spent
inside ``next(loader)`` over three epochs of fast-path uint8 batches after a warm-up one, with a loop that does
nothing with them, per run mode; goal <= 10 us per image in every mode.

The second part runs ``run_precompute`` (what ``precompute-features`` runs) with a null backbone (a mean over the
pixels: no model time) and prints the consumer pipeline's stage seconds (``stages`` of its summary): prepare (moving
or decoding and cropping a chunk), forward, the copy back, assembly, writing, and the wait for the loader, per image.

    .venv/bin/python scripts/bench/feed.py --quick      # under a minute on 2 cores
    .venv/bin/python scripts/bench/feed.py --images 3000 --batch-size 256

Progress and the table go to stderr; stdout gets one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GOAL_US = 10.0
MEASURED_EPOCHS = 3


def main_thread_us(dataset: Any, mode: Any, batch_size: int) -> dict[str, Any]:
    """Main-thread CPU microseconds per image inside ``next()`` (freeing the batch before included), over
    ``MEASURED_EPOCHS`` epochs after a warm-up epoch (workers starting, buffers made)."""
    import shards

    loader = shards.make_loader(dataset, batch_size, mode=mode, drop_last=False, pin_memory=False)
    cpu = images = 0.0
    wall = time.perf_counter()
    try:
        for epoch in range(1 + MEASURED_EPOCHS):
            if epoch == 1:  # the warm-up epoch's numbers are dropped
                cpu = images = 0.0
                wall = time.perf_counter()
            loader.set_epoch(epoch)
            batches = iter(loader)
            while True:
                before = time.thread_time()
                batch = next(batches, None)
                cpu += time.thread_time() - before
                if batch is None:
                    break
                images += len(batch[1])
        wall = time.perf_counter() - wall
    finally:
        loader.close()
    return {"main_thread_us_per_image": round(cpu / images * 1e6, 2), "images_per_s": round(images / wall, 1),
            "images": int(images)}


def modes(workers: int) -> dict[str, Any]:
    from shards.loader.threads import Threads
    from shards.loader.worker_processes import WorkerProcesses

    return {"processes": WorkerProcesses(workers, persistent=True), "threads": Threads(workers),
            "mtp": WorkerProcesses(max(1, workers // 2), persistent=True, decoders=2)}


def null_backbone_stages(folder: Path, out: Path, batch_size: int, workers: int) -> dict[str, Any]:
    """``run_precompute`` with the backbone's model replaced by a pixel mean: the consumer loop alone."""
    import torch

    from preprocess.features import featurize

    class PixelMean(torch.nn.Module):
        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return images.float().mean(dim=(2, 3))

    build = featurize.build_backbone

    def null_build(*args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(build(*args, **kwargs), model=PixelMean(), features_dim=3)

    featurize.build_backbone = null_build
    try:
        cfg = featurize.FeatureConfig(folder, out, backbone="mobilenet_v3_small", weights="none", batch_size=batch_size,
                                      workers=workers, decode="fast", dtype="float32", quiet=True, overwrite=True)
        _, summary = featurize.run_precompute(cfg)
    finally:
        featurize.build_backbone = build
    images = max(1, summary["images"])
    stages = summary.get("stages", {})
    return {"images": summary["images"], "images_per_s": summary["images_per_s"],
            "stage_us_per_image": {name: round(seconds / images * 1e6, 1) for name, seconds in stages.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="768 images, batch 256: under a minute on 2 cores")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the corpus here (default: a temp folder)")
    args = parser.parse_args()
    if args.quick:
        args.images, args.batch_size = 768, 256

    import torch

    import loader as bench
    import shards

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="feed-bench-") as scratch:
        workdir = args.workdir or Path(scratch)
        files = bench.build_corpus(workdir / "images", args.images)
        bench.pack(files, workdir / "tar", "tar", per_shard=max(50, args.images // 8))
        dataset = shards.open_dataset(workdir / "tar", transform=bench.SPEC, decode=shards.Decode("fast"), seed=0)
        result: dict[str, Any] = {"images": args.images, "batch_size": args.batch_size, "workers": args.workers,
                                  "goal_us_per_image": GOAL_US, "modes": {}}
        for name, mode in modes(args.workers).items():
            result["modes"][name] = main_thread_us(dataset, mode, args.batch_size)
            print(f"{name:>10}: {result['modes'][name]['main_thread_us_per_image']:7.2f} us/img on the main thread, "
                  f"{result['modes'][name]['images_per_s']:8.1f} img/s", file=sys.stderr)
        result["precompute_null_model"] = null_backbone_stages(workdir / "tar", workdir / "features",
                                                               args.batch_size, args.workers)
        print(f"precompute, null model: {result['precompute_null_model']}", file=sys.stderr)
        result["within_goal"] = all(m["main_thread_us_per_image"] <= GOAL_US for m in result["modes"].values())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
