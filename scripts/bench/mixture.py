"""Benchmark: what mixing sources and filtering rows cost the fast pipeline, against one plain dataset folder.

One generated corpus of JPEGs (about 400x300, ~60 KB, 4 classes) is packed with ``pack-shards``'s library API
three ways: as one folder A, split into two folders A1 and A2 (every class in both; 5/8 and 3/8 of the files,
rounded to whole shards), and unshuffled (class by class) as A_sorted. The passes, interleaved round by round
(every other round in reverse order, so no pass always follows the same one) with the page cache of the folders'
files dropped before each, run the fast pipeline (eval preset, uint8 batches, 2 workers) over:

- ``plain``: A as it is, no mixture (the unchanged path);
- ``mix``: A1 and A2 mixed with weights proportional to their sizes, so an epoch holds the same samples as A;
- ``where``: A with ``Subset(where="width >= 0")``: every sample kept, but the filter runs at open time (from the
  source index) and the epoch streams through the mixture plan;
- ``classes`` and ``classes_sorted``: half the classes of A and of A_sorted; they read fewer samples (and on
  A_sorted fewer shards: the table says how many of the source's shards were kept), so they are reported, not
  counted in the overhead ratios.

Each ``io_*`` pass is plain, mix or where with a decoder that returns 0, so what is left is reading and the plan;
it runs ``--io-epochs`` epochs on one loader (the first cold, the rest warm) so worker start-up does not swamp it.
The ``io0_*`` passes do the same with no workers, in this process: no start-up or inter-process noise, so their
ratios are the per-sample overhead of the mixture's reads at its plainest.
Rates count from the loader's first batch request to its last batch (worker start-up included); opening the
dataset (manifests, the subset's selection) is timed apart (``open s``) and folded in only in the ``w/ open``
column and the ``*_with_open`` ratios. ``img/CPU-s`` divides by the CPU seconds of this process and its (joined)
workers instead of wall time: on a machine other work shares, it moves far less than wall-clock rates, so its
``*_per_cpu_s`` ratios cross-check the headline ones. A ``where`` open on a copy of A without its source index (so the filter
reads every shard) prices the fallback. The epoch plan line gives the pure cost of dealing an epoch to the
workers (``plan_epoch`` against the mixture's draw) and the reads it makes (whole-shard slices are the ones whose
sha256 is checked while streaming), so the passes can be seen to compare like with like.

    python scripts/bench/mixture.py            # 2000 images in 8 shards, 9 rounds, ~2 minutes on 2 cores
    python scripts/bench/mixture.py --quick    # 800 images, 5 rounds, ~25 s

Progress and the table go to stderr; stdout gets one JSON line with the rates, the open times and the ratios
``mix_vs_plain`` and ``where_vs_plain`` (goal: at least 0.95, mixing overhead under 5%).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import loader as bench  # noqa: E402  (scripts/bench/loader.py: the corpus and page-cache dropping)

import shards  # noqa: E402
from preprocess.pack.packer import PackConfig, pack_manifest  # noqa: E402
from shards.jobs.progress import setup_logging  # noqa: E402
from shards.stream.dataset import ShardDataset  # noqa: E402
from shards.loader.loader import workers_mode  # noqa: E402

log = logging.getLogger("bench.mixture")
CLASSES = [f"class{i}" for i in range(4)]
FIRST_SHARE = 5 / 8  # of the files, into A1 (the rest into A2): weights 0.625 / 0.375
GOAL = 0.95
COUNTED = ("mix", "where")  # the configurations the overhead ratios are about
COUNTED_AGAINST = ("plain", *COUNTED)


# -- corpus --------------------------------------------------------------------------------------------------------
def build_tree(folder: Path, count: int) -> dict[str, list[Path]]:
    """The loader benchmark's corpus generator at 400x300 (~60 KB), grouped by class."""
    files_by_class: dict[str, list[Path]] = {name: [] for name in CLASSES}
    for path in bench.build_corpus(folder, count, classes=CLASSES, size=(400, 300)):
        files_by_class[path.parent.name].append(path)
    return files_by_class


def split_tree(files_by_class: dict[str, list[Path]], first: Path, second: Path, per_shard: int) -> tuple[int, int]:
    """The tree as two hard-linked trees with every class in both: ``first`` gets about ``FIRST_SHARE`` of the
    files, rounded to whole shards (so neither source ends in a stub shard), spread evenly over the classes."""
    total = sum(len(files) for files in files_by_class.values())
    wanted = min(total - 1, max(1, round(total * FIRST_SHARE / per_shard) * per_shard))
    cuts = [wanted // len(files_by_class) + (i < wanted % len(files_by_class)) for i in range(len(files_by_class))]
    for (name, files), cut in zip(files_by_class.items(), cuts):
        for tree, part in ((first, files[:cut]), (second, files[cut:])):
            (tree / name).mkdir(parents=True, exist_ok=True)
            for path in part:
                target = tree / name / path.name
                if not target.exists():
                    try:
                        os.link(path, target)
                    except OSError:  # another file system: copy
                        shutil.copyfile(path, target)
    return wanted, total - wanted


def pack_tree(source: Path, out: Path, per_shard: int, shuffle: bool = True) -> Path:
    if not (out / "dataset.json").is_file():
        pack_manifest(PackConfig(source=str(source), out=str(out), max_samples=per_shard, shuffle=shuffle, workers=2,
                                 quiet=True))
    return out


def without_source_index(folder: Path, out: Path, *, byte_index: bool = True) -> Path:
    """A copy of ``folder`` (its files hard-linked) whose manifest names no source index and no column index, so a
    filter reads shards;
    ``byte_index=False`` drops the tar shards' byte indexes too, as a dataset packed before them (reads scan)."""
    if (out / "dataset.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((folder / "dataset.json").read_text())
    index_name = manifest.pop("source_index")["path"]  # an unknown top-level key, kept in the manifest's extra
    manifest.pop("columns", None)  # the column index too (its files are not linked): the filter reads the shards
    if not byte_index:
        for split in manifest["splits"].values():
            for shard in split["shards"]:
                shard.pop("index", None)
                shard.pop("index_sha256", None)
    for path in folder.iterdir():
        if path.is_file() and path.name not in ("dataset.json", index_name) and (byte_index or path.suffix != ".idx"):
            os.link(path, out / path.name)  # the reader refuses a shard symlinked out of its folder
    (out / "dataset.json").write_text(json.dumps(manifest))
    return out


def drop_cache(folders: list[Path]) -> None:
    """Every file of the folders leaves the page cache, manifests and indexes too."""
    bench.drop_cache(path for folder in folders for path in folder.iterdir() if path.is_file())


# -- passes --------------------------------------------------------------------------------------------------------
def no_decode(sample: Any, seed: int) -> int:
    """The I/O-only decoder: the sample was read, nothing is decoded (module level, so workers can pickle it)."""
    return 0


def pass_specs(folders: dict[str, Path], sizes: tuple[int, int], spec: shards.TransformSpec) -> dict[str, tuple]:
    """Name -> (``open_dataset`` source, its options, the folders read): the decode passes, then the I/O-only ones."""
    half = shards.Subset(classes=CLASSES[: len(CLASSES) // 2])
    mix = [shards.SourceSpec(str(folders["A1"]), weight=sizes[0] / sum(sizes)),
           shards.SourceSpec(str(folders["A2"]), weight=sizes[1] / sum(sizes))]
    sources = {
        "plain": (str(folders["A"]), {}, [folders["A"]]),
        "mix": (mix, {}, [folders["A1"], folders["A2"]]),
        "where": (shards.SourceSpec(folders["A"], subset=shards.Subset(where="width >= 0")), {}, [folders["A"]]),
        "classes": (shards.SourceSpec(folders["A"], subset=half), {}, [folders["A"]]),
        "classes_sorted": (shards.SourceSpec(folders["A_sorted"], subset=half), {}, [folders["A_sorted"]]),
    }
    passes = {}
    for name, (source, options, read) in sources.items():
        passes[name] = (source, {**options, "transform": spec, "decode": shards.Decode("fast")}, read)
    for prefix in ("io_", "io0_"):
        for name in COUNTED_AGAINST:
            source, options, read = sources[name]
            passes[f"{prefix}{name}"] = (source, {**options, "decode": shards.Decode(decoder=no_decode)}, read)
    # Half the classes of a shuffled pack without byte indexes: scattered rows, every read a header walk from the
    # shard's start unless one read covers a shard's rows (plan.covering_reads). Reads less: reported, not counted.
    passes["io0_classes_bare"] = (shards.SourceSpec(folders["A_bare"], subset=half),
                                  {"decode": shards.Decode(decoder=no_decode)}, [folders["A_bare"]])
    return passes


def timed_pass(name: str, source: Any, options: dict, read: list[Path], args) -> dict[str, Any]:
    """One pass, page cache dropped first: open (timed apart), then ``epochs`` epochs through one ``make_loader``
    (workers kept between epochs, so later epochs are warm); rate, open seconds, shards kept."""
    epochs = args.io_epochs if name.startswith("io") else args.epochs
    workers = 0 if name.startswith("io0_") else args.workers  # io0_: in this process, no worker noise
    drop_cache(read)
    began = time.perf_counter()
    dataset = shards.open_dataset(source, "train", seed=0, **options)
    opened, cpu_began = time.perf_counter(), cpu_seconds()
    normalize = dataset.normalizer() if args.consumer == "normalize" and not name.startswith("io") else None
    loader = shards.make_loader(dataset, batch_size=args.batch_size,
                                mode=workers_mode(workers, persistent=epochs > 1 and workers > 0), drop_last=False)
    seen = 0
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for images, labels in loader:
            if normalize is not None:
                normalize(images)
            seen += len(labels)
    ended = time.perf_counter()
    del loader  # its workers exit and are reaped, so their CPU seconds are counted
    gc.collect()
    cpu = cpu_seconds() - cpu_began
    if seen != epochs * len(dataset):
        raise RuntimeError(f"{name}: saw {seen} images in {epochs} epoch(s) of {len(dataset)}")
    result = {"rate": seen / (ended - opened), "total_rate": seen / (ended - began), "cpu_rate": seen / cpu,
              "open_s": opened - began, "images": len(dataset), "shards": len(dataset.split_info.shards)}
    log.info("%-16s %8.1f img/s, %8.1f img/CPU-s  (%d images in %.2f s, open %.3f s, %d shards)", name,
             result["rate"], result["cpu_rate"], seen, ended - opened, result["open_s"], result["shards"])
    dataset.close()
    return result


def cpu_seconds() -> float:
    """User and system seconds of this process and its reaped children (the loader's workers, once joined)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def alternating_rounds(passes: dict[str, tuple], args, noindex: Path) -> dict[str, list[dict[str, Any]]]:
    """Every pass once per round, every other round in reverse order, so no pass always follows the same one;
    each pass's result per round. A round also opens ``where`` on the index-less copy (open time only)."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in passes}
    results["open_where_noindex"] = []
    for round_index in range(args.rounds):
        names = list(passes) if round_index % 2 == 0 else list(reversed(passes))
        for name in names:
            results[name].append(timed_pass(name, *passes[name], args))
        results["open_where_noindex"].append(open_only(noindex, shards.Subset(where="width >= 0")))
    return results


def open_only(folder: Path, subset: shards.Subset) -> dict[str, Any]:
    drop_cache([folder])
    began = time.perf_counter()
    dataset = shards.open_dataset(shards.SourceSpec(folder, subset=subset), "train", transform=None, seed=0)
    result = {"open_s": time.perf_counter() - began, "images": len(dataset), "shards": len(dataset.split_info.shards)}
    dataset.close()
    return result


def plan_us_per_sample(dataset: ShardDataset, workers: int, batch_size: int, epochs: int = 20) -> float:
    """Microseconds per sample to deal epochs to ``workers`` workers (a new epoch each time: nothing cached)."""
    best = float("inf")
    for repeat in range(3):
        began = time.perf_counter()
        for epoch in range(epochs):
            for worker in range(workers):
                dataset.worker_plan(1000 * repeat + epoch, worker, workers, split_batch=batch_size)
        best = min(best, time.perf_counter() - began)
    return best / (epochs * len(dataset)) * 1e6


def plan_shapes(passes: dict[str, tuple], args) -> tuple[dict[str, float], dict[str, dict[str, int]]]:
    """Per configuration: the plan's cost per sample, and epoch 0's reads (slices, and whole-shard slices, which
    are the ones whose sha256 is checked while streaming): the passes compare like with like only if these match."""
    costs, shapes = {}, {}
    for name in ("plain", "mix", "where"):
        source, options, _ = passes[name]
        dataset = shards.open_dataset(source, "train", seed=0, **options)
        costs[name] = plan_us_per_sample(dataset, args.workers, args.batch_size)
        pieces = [p for w in range(args.workers) for p in dataset.worker_plan(0, w, args.workers,
                                                                              split_batch=args.batch_size)]
        sizes = dataset.split_info.shard_sizes
        shapes[name] = {"slices": len(pieces),
                        "whole_shards": sum(p.start == 0 and p.stop >= sizes[p.shard] for p in pieces)}
        dataset.close()
    return costs, shapes


# -- report --------------------------------------------------------------------------------------------------------
def summarise(results: dict[str, list[dict[str, Any]]], source_shards: dict[str, int]) -> dict[str, dict[str, Any]]:
    rows = {}
    for name, runs in results.items():
        row = {"open_s_best": min(r["open_s"] for r in runs),
               "open_s_median": statistics.median(r["open_s"] for r in runs),
               "images": runs[0]["images"], "shards": runs[0]["shards"]}
        if "rate" in runs[0]:
            row.update(best=max(r["rate"] for r in runs), median=statistics.median(r["rate"] for r in runs),
                       total_best=max(r["total_rate"] for r in runs), cpu_best=max(r["cpu_rate"] for r in runs))
        read_from = "A_sorted" if name.endswith("sorted") else "A1+A2" if name.endswith("mix") else "A"
        row["shards_opened"] = row["shards"] / source_shards[read_from]
        rows[name] = row
    return rows


def ratios_of(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    ratios = {}
    for prefix in ("", "io_", "io0_"):
        plain = rows[f"{prefix}plain"]
        for name in COUNTED:
            row = rows[f"{prefix}{name}"]
            ratios[f"{prefix}{name}_vs_plain"] = row["best"] / plain["best"]
            ratios[f"{prefix}{name}_vs_plain_median"] = row["median"] / plain["median"]
            ratios[f"{prefix}{name}_vs_plain_with_open"] = row["total_best"] / plain["total_best"]
            ratios[f"{prefix}{name}_vs_plain_per_cpu_s"] = row["cpu_best"] / plain["cpu_best"]
    return ratios


def report(rows: dict[str, dict[str, Any]], ratios: dict[str, float], plan_us: dict[str, float],
           shapes: dict[str, dict[str, int]]) -> str:
    lines = [f"{'pass':<18}{'best img/s':>11}{'median':>9}{'w/ open':>9}{'img/CPU-s':>10}{'open s':>8}"
             f"{'images':>7}{'shards':>11}"]
    for name, row in rows.items():
        rates = (f"{row['best']:>11.1f}{row['median']:>9.1f}{row['total_best']:>9.1f}{row['cpu_best']:>10.1f}"
                 if "best" in row else f"{'-':>11}{'-':>9}{'-':>9}{'-':>10}")
        lines.append(f"{name:<18}{rates}{row['open_s_best']:>8.3f}{row['images']:>7}"
                     f"{row['shards']:>5} ({row['shards_opened']:.0%})")
    lines += [f"{name:<36}{value:>8.3f}" for name, value in ratios.items()]
    lines.append("selection at open (best open s minus plain's): " + ", ".join(
        f"{label} {rows[name]['open_s_best'] - rows['plain']['open_s_best']:+.3f} s"
        for name, label in (("mix", "mix"), ("where", "where (source index)"),
                            ("open_where_noindex", "where (no index: reads every shard)"))))
    lines.append("epoch plan: " + ", ".join(
        f"{k} {plan_us[k]:.3f} us/sample, {v['slices']} slices ({v['whole_shards']} whole shards)"
        for k, v in shapes.items()))
    met = all(ratios[f"{name}_vs_plain"] >= GOAL for name in COUNTED)
    lines.append(f"mixing overhead <5%: ratio >= {GOAL} (best of rounds, fast pipeline): "
                 + ", ".join(f"{name} {ratios[f'{name}_vs_plain']:.3f}" for name in COUNTED)
                 + (" -> met" if met else " -> NOT met") + "; per CPU second (steadier when other work shares the "
                 "cores): " + ", ".join(f"{name} {ratios[f'{name}_vs_plain_per_cpu_s']:.3f}" for name in COUNTED))
    return "\n".join(lines)


def corpus(args, workdir: Path) -> tuple[dict[str, Path], tuple[int, int]]:
    files_by_class = build_tree(workdir / "images", args.images)
    sizes = split_tree(files_by_class, workdir / "images_a1", workdir / "images_a2", args.per_shard)
    folders = {"A": pack_tree(workdir / "images", workdir / "A", args.per_shard),
               "A1": pack_tree(workdir / "images_a1", workdir / "A1", args.per_shard),
               "A2": pack_tree(workdir / "images_a2", workdir / "A2", args.per_shard),
               "A_sorted": pack_tree(workdir / "images", workdir / "A_sorted", args.per_shard, shuffle=False)}
    folders["A_noindex"] = without_source_index(folders["A"], workdir / "A_noindex")
    folders["A_bare"] = without_source_index(folders["A"], workdir / "A_bare", byte_index=False)
    os.sync()
    return folders, sizes


def run(args, workdir: Path) -> None:
    load_at_start = os.getloadavg()[0]  # before this run's own work: a hint that something else shares the cores
    if load_at_start > 0.5:
        log.warning("load average %.2f at start: other work may share the cores, rates will be noisy", load_at_start)
    folders, sizes = corpus(args, workdir)
    source_shards = {name: len(shards.open_dataset(str(f), "train").split_info.shards) for name, f in folders.items()}
    source_shards["A1+A2"] = source_shards["A1"] + source_shards["A2"]
    mean_kb = np.mean([p.stat().st_size for p in (workdir / "images").rglob("*.jpg")]) / 1024
    log.info("corpus: %d JPEGs (mean %.0f KB) in %s; A %d shards, A1 %d + A2 %d samples (%d + %d shards); "
             "%d workers, batch %d, eval %d px", args.images, mean_kb, workdir, source_shards["A"], *sizes,
             source_shards["A1"], source_shards["A2"], args.workers, args.batch_size, args.size)
    spec = shards.TransformSpec(preset="eval", size=args.size)
    passes = pass_specs(folders, sizes, spec)
    results = alternating_rounds(passes, args, folders["A_noindex"])
    rows = summarise(results, source_shards)
    ratios = ratios_of(rows)
    plan_us, shapes = plan_shapes(passes, args)
    print(report(rows, ratios, plan_us, shapes), file=sys.stderr)
    rounded = {name: {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
               for name, row in rows.items()}
    print(json.dumps({"images": args.images, "per_shard": args.per_shard, "workers": args.workers,
                      "batch_size": args.batch_size, "size": args.size, "rounds": args.rounds,
                      "epochs": args.epochs, "io_epochs": args.io_epochs,
                      "consumer": args.consumer, "mean_file_kb": round(float(mean_kb), 1),
                      "split_sizes": list(sizes),
                      "images_per_s": {k: round(v["best"], 1) for k, v in rows.items() if "best" in v},
                      "passes": rounded, "ratios": {k: round(v, 4) for k, v in ratios.items()},
                      "plan_us_per_sample": {k: round(v, 4) for k, v in plan_us.items()},
                      "plan_slices": shapes,
                      "load_average_at_start": round(load_at_start, 2),
                      "goal": GOAL, "goal_met": all(ratios[f"{n}_vs_plain"] >= GOAL for n in COUNTED)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--per-shard", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=9, help="rounds over all passes; best and median are kept")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per decoding pass (the first one cold)")
    parser.add_argument("--io-epochs", type=int, default=5, help="epochs per I/O-only pass (the first one cold)")
    parser.add_argument("--quick", action="store_true", help="800 images in 8 shards, 5 rounds: about 30 s")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--size", type=int, default=160, help="the eval preset's output side")
    parser.add_argument("--consumer", choices=("uint8", "normalize"), default="uint8",
                        help="count uint8 batches (a GPU consumer's CPU cost) or normalise them here first")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the corpus here between runs")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.images, args.per_shard, args.rounds, args.io_epochs = 800, 100, 5, 3
    setup_logging(quiet=args.quiet)
    torch.set_num_threads(1)  # the main process only counts batches; its threads would spin on the workers' cores
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardcache-mixture-"))
    try:
        run(args, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
