"""Benchmark: epoch 1 against later epochs with the decoded-image cache (``open_dataset(cache="memory")``).

On a CPU the fast pipeline's epoch is decoding and resizing; a dataset that fits in memory decodes the same files
every epoch. This runs a few epochs of the fast pipeline per dataset and preset (eval: Resize + CenterCrop, train:
RandomResizedCrop + flip) with the cache and without it, 2 persistent DataLoader workers, the page cache of the
shards dropped before epoch 1, and prints img/s per epoch side by side with the ratio of epoch 2 to epoch 1.
The consumer only counts uint8 batches (a GPU consumer normalises on the device); ``--consumer normalize``
normalises on the CPU instead, as ``loader.py``'s headline numbers do.

Datasets: loader.py's generated corpus (500x375 JPEGs, ~95 KB, at 224 px), and the ELPV solar cells (300x300
grayscale PNGs, at 128 px, the train split of the demo's tree) when they are here: ``--elpv DIR`` (packed shards
or an ImageFolder tree with train/ and val/), else ``data/elpv`` (scripts/demo builds it), else built from the
``elpv-dataset`` package when installed; otherwise ELPV is skipped, and the run says so.

    python scripts/bench/image_cache.py                # 3000 JPEGs + ELPV, ~3 minutes on 2 cores
    python scripts/bench/image_cache.py --quick        # 600 JPEGs

Progress and the table go to stderr; stdout gets one JSON line with the rates and ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import shards  # noqa: E402
from loader import build_corpus, drop_cache, pack  # noqa: E402
from shards.jobs.progress import setup_logging  # noqa: E402
from shards.loader.loader import workers_mode  # noqa: E402

log = logging.getLogger("bench.image_cache")
PRESETS = ("eval", "train")


def elpv_shards(args, workdir: Path) -> Path | None:
    """Packed ELPV shards (the train split of the demo's stratified tree), or None when ELPV is not here."""
    source = args.elpv
    if source is None and (ROOT / "data" / "elpv" / "train").is_dir():
        source = ROOT / "data" / "elpv"
    if source is None:
        try:
            import demo_data

            source = demo_data.build_elpv_tree(ROOT / "data" / "elpv")[0]
        except Exception as exc:  # the package is optional: the demo installs it
            log.warning("ELPV not found (no --elpv, no data/elpv, %s): skipped; scripts/demo installs it", exc)
            return None
    if (source / "dataset.json").is_file():
        return source
    out = workdir / "elpv-shards"
    if not (out / "dataset.json").is_file():
        from preprocess.pack.packer import PackConfig, pack_manifest

        pack_manifest(PackConfig(source=str(source), out=str(out), max_samples=500, quiet=True))
    return out


def epoch_rates(folder: Path, spec: shards.TransformSpec, cache: str, args) -> list[float]:
    """img/s of each epoch of one loader (workers persist across epochs, so only epoch 1 starts them)."""
    dataset = shards.open_dataset(folder, "train", transform=spec, decode=shards.Decode("fast"), seed=0, cache=cache)
    normalize = dataset.normalizer() if args.consumer == "normalize" else None
    loader = shards.make_loader(dataset, batch_size=args.batch_size, mode=workers_mode(args.workers), drop_last=False)
    drop_cache(sorted(folder.glob("*.tar")))
    rates = []
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        began, seen = time.perf_counter(), 0
        for images, labels in loader:
            if normalize is not None:
                normalize(images)
            seen += len(labels)
        rates.append(seen / (time.perf_counter() - began))
    if cache == "memory":
        log.info("  cache: %s", dataset.image_cache.stats())
    del loader
    dataset.close()
    return rates


def measure(name: str, folder: Path, size: int, args) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {}
    for preset in PRESETS:
        spec = shards.TransformSpec(preset=preset, size=size)
        for cache in ("none", "memory"):
            best: list[float] = []
            for _ in range(args.repeat):
                rates = epoch_rates(folder, spec, cache, args)
                best = [max(pair) for pair in zip(best, rates)] if best else rates
            key = f"{preset}_{'cached' if cache == 'memory' else 'uncached'}"
            results[key] = best
            log.info("%-6s %-16s %s img/s", name, key, " / ".join(f"{r:,.0f}" for r in best))
    return results


def table(all_results: dict[str, dict[str, list[float]]]) -> str:
    lines = ["", "| dataset | pipeline | epoch 1 img/s | epoch 2 img/s | epoch 3+ img/s | epoch 2 / epoch 1 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, results in all_results.items():
        for key, rates in results.items():
            later = max(rates[2:]) if len(rates) > 2 else float("nan")
            lines.append(f"| {name} | {key} | {rates[0]:,.0f} | {rates[1]:,.0f} | {later:,.0f} | "
                         f"{rates[1] / rates[0]:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="600 generated JPEGs")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1, help="passes per loader; each epoch's best counts")
    parser.add_argument("--consumer", choices=("uint8", "normalize"), default="uint8")
    parser.add_argument("--elpv", type=Path, default=None, help="ELPV shards or ImageFolder tree (train/, val/)")
    parser.add_argument("--no-corpus", action="store_true", help="ELPV only")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the corpus here between runs")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2")
    setup_logging(quiet=args.quiet)
    torch.set_num_threads(1)  # the consumer leaves the cores to the workers
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardcache-bench-cache-"))
    all_results: dict[str, dict[str, list[float]]] = {}
    try:
        if not args.no_corpus:
            count = 600 if args.quick else args.images
            files = build_corpus(workdir / "images", count)
            pack(files, workdir / "tar", "tar", 150 if args.quick else 500)
            log.info("corpus: %d generated JPEGs (500x375) at 224 px, %d workers", count, args.workers)
            all_results["corpus"] = measure("corpus", workdir / "tar", 224, args)
        elpv = elpv_shards(args, workdir)
        if elpv is not None:
            samples = shards.open_dataset(elpv, "train").split_info.samples
            log.info("ELPV: %d train images (300x300 PNG) at 128 px from %s", samples, elpv)
            all_results["elpv"] = measure("elpv", elpv, 128, args)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(all_results), file=sys.stderr)
    print(json.dumps({"workers": args.workers, "batch_size": args.batch_size, "consumer": args.consumer,
                      "elpv": "elpv" in all_results,
                      "images_per_s": {f"{n}/{k}": [round(r, 1) for r in v] for n, res in all_results.items()
                                       for k, v in res.items()},
                      "epoch2_over_epoch1": {f"{n}/{k}": round(v[1] / v[0], 2) for n, res in all_results.items()
                                             for k, v in res.items()}}))


if __name__ == "__main__":
    main()
