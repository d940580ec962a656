#!/usr/bin/env python
"""Benchmark: what every stage costs at 20k, 200k and 1.28M samples (issue 22's goals), measured, not extrapolated.

Per size, on a tiny-JPEG ImageFolder corpus (``scripts/bench/corpus.py``: 64x64, ~1.3 kB per file; 100 classes
below a million files, 1,000 at 1.28M), kept in ``$SHARDCACHE_BENCH_CACHE`` (default ``/var/tmp/shardcache-bench``)
with the dataset packed from it, since writing and packing 1.28M files takes a while:

- ``pack``: ``pack-shards --workers 2 --verify header``: seconds and the largest process's peak RSS (the main
  process or one of its workers). Measured when the dataset is packed; ``--repack`` packs again.
  ``--pack-speedup N`` also packs the N-file corpus with 1 and with 2 workers, side by side, for the ratio.
- ``open``: ``open_dataset`` + the first batch (2 DataLoader workers, an I/O-only decoder), each variant in a fresh
  process: plain, a 2-class subset, ``where="width >= 64"``, a 1,000-key list, a two-source mixture (the dataset
  twice, each with a class subset). Peak RSS growth over an ``import shards, torch`` in the same process, and the
  PSS of a node running two ranks (each with its 2 workers) summed, so shared pages count once.
- ``epoch``: one I/O-only epoch (2 workers, batch 256): samples/s; the loader's ``state_dict`` at half the epoch
  (JSON bytes), and an elastic resume of that state with 3 workers and batch 192 in a fresh process: seconds from
  ``open_dataset`` to the first batch.
- ``verify`` (default checks) with 1 and 2 workers, ``inspect`` and ``report`` of the dataset, through the CLI.
- ``plan`` (``--plan SAMPLES:SHARDS``, default 1280000:1280): ``shards plan`` in a fresh process over a synthetic
  manifest of that many samples in that many shards of 128 MiB (no shard bytes exist: the forecast never reads one),
  for a few layouts, with and without a node cache that holds half the dataset. ``--plan-only`` runs just these.

    .venv/bin/python scripts/bench/scale.py --sizes 20000            # a quick look, ~2 minutes
    .venv/bin/python scripts/bench/scale.py --sizes 20000,200000,1280000 --pack-speedup 200000
    .venv/bin/python scripts/bench/scale.py --plan-only                # shards plan at 1.28M samples, ~1 minute

The table goes to stderr (and ``--markdown FILE``); the last stdout line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from corpus import DEFAULT_CACHE, corpus  # noqa: E402

BIN = Path(sys.executable).parent
VARIANTS = ("plain", "classes", "where", "keys", "mixture")
BATCH = 256
KEYS_FILE = "bench-keys.json"  # beside the packed dataset: the key list variant's 1,000 keys


def log(message: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def classes_for(files: int) -> int:
    return 1000 if files >= 1_000_000 else 100


# -- measuring a command -------------------------------------------------------------------------------------------
def run_measured(argv: list[str], *, cwd: Path | None = None) -> dict[str, Any]:
    """Run ``argv`` to completion in a fresh process group: seconds, and the largest peak RSS among it and its
    descendants (``RUSAGE_CHILDREN`` of a wrapper process that runs only this one command)."""
    wrapper = ("import resource, subprocess, sys, json, time; t = time.monotonic(); "
               "p = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True); "
               "print(json.dumps({'rc': p.returncode, 'seconds': time.monotonic() - t, 'stderr': p.stderr[-2000:], "
               "'max_rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))")
    out = subprocess.run([sys.executable, "-c", wrapper, *argv], cwd=cwd, stdout=subprocess.PIPE, check=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result.pop("rc") != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{result['stderr']}")
    del result["stderr"]
    return result


def child(*args: str) -> dict[str, Any]:
    """Run one measurement of this script in a fresh process; its last stdout line is its JSON result."""
    out = subprocess.run([sys.executable, __file__, "--child", *args], stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- pack ----------------------------------------------------------------------------------------------------------
def pack(source: Path, out: Path, workers: int) -> dict[str, Any]:
    if out.exists():
        shutil.rmtree(out)
    log(f"pack {source.name} -> {out.name} with {workers} worker(s)")
    return run_measured([str(BIN / "pack-shards"), str(source), "--out", str(out), "--workers", str(workers),
                         "--verify", "header", "--quiet"])


def packed(files: int, cache: Path, repack: bool, label: str) -> tuple[Path, dict[str, Any]]:
    """The packed dataset of the ``files`` corpus and the pack figures recorded when it was made."""
    source = corpus(files, classes_for(files), cache=cache)
    out = cache / f"packed{label}-{source.name}"
    stamp = cache / f"packed{label}-{source.name}.json"
    if not repack and stamp.is_file() and (out / "dataset.json").is_file():
        return out, json.loads(stamp.read_text())
    figures = pack(source, out, workers=2)
    stamp.write_text(json.dumps(figures))
    return out, figures


def pack_speedup(files: int, cache: Path) -> dict[str, Any]:
    source = corpus(files, classes_for(files), cache=cache)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        one = pack(source, Path(tmp) / "w1", 1)
        two = pack(source, Path(tmp) / "w2", 2)
    return {"files": files, "one_worker_s": one["seconds"], "two_workers_s": two["seconds"],
            "speedup": one["seconds"] / two["seconds"], "one_rss_mb": one["max_rss_mb"],
            "two_rss_mb": two["max_rss_mb"]}


# -- measurements that run in a fresh process ----------------------------------------------------------------------
def no_decode(raw: Any, seed: Any = None) -> int:
    """The I/O-only decoder: what is left of a pass is reading, checking and the plan."""
    return len(raw.data)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _pss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _child_pids(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _open(dataset: str, variant: str, rank: int = 0, world: int = 1):
    import shards

    # The corpus's class names (corpus.py): reading them from dataset.json here would time a second manifest load.
    classes = [f"c{c:04d}" for c in range(classes_for(int(Path(dataset).name.split("-")[-3])))]
    options = dict(decode=shards.Decode(decoder=no_decode), seed=0,
                   distributed=shards.Distributed(rank=rank, world_size=world))
    if variant == "plain":
        return shards.open_dataset(dataset, **options)
    if variant == "classes":
        return shards.open_dataset(shards.SourceSpec(dataset, subset=shards.Subset(classes=tuple(classes[:2]))),
                                   **options)
    if variant == "where":
        return shards.open_dataset(shards.SourceSpec(dataset, subset=shards.Subset(where="width >= 64")), **options)
    if variant == "keys":
        keys = json.loads(Path(str(dataset) + "." + KEYS_FILE).read_text())
        return shards.open_dataset(shards.SourceSpec(dataset, subset=shards.Subset(keys=keys)), **options)
    if variant == "mixture":
        half = len(classes) // 2
        return shards.open_dataset([shards.SourceSpec(dataset, subset=shards.Subset(classes=tuple(classes[:half]))),
                                    shards.SourceSpec(dataset, subset=shards.Subset(classes=tuple(classes[half:])))],
                                   **options)
    raise SystemExit(f"unknown variant {variant}")


def _imports() -> None:
    """What a training script has imported before it opens a dataset: torch and the reader (``shards`` imports
    lazily, so its first ``open_dataset`` would otherwise pay for torch's import inside the timing)."""
    import torch  # noqa: F401
    import shards.stream.reader  # noqa: F401


def measure_open(dataset: str, variant: str, rank: int, world: int, barrier: str | None) -> dict[str, Any]:
    import shards

    _imports()
    base = _rss_mb()
    start = time.monotonic()
    ds = _open(dataset, variant, rank, world)
    opened = time.monotonic()
    from shards.loader.worker_processes import WorkerProcesses
    loader = shards.make_loader(ds, BATCH, mode=WorkerProcesses(2), drop_last=False)
    batches = iter(loader)
    next(batches)
    first = time.monotonic()
    result = {"open_s": opened - start, "first_batch_s": first - start, "rss_growth_mb": _rss_mb() - base,
              "samples": len(ds)}
    if barrier is not None:  # every rank of the "node" is up: measure the PSS of this rank and its workers
        Path(f"{barrier}.{rank}").touch()
        deadline = time.monotonic() + 600
        while not all(Path(f"{barrier}.{r}").exists() for r in range(world)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        result["pss_mb"] = _pss_mb([os.getpid(), *_child_pids(os.getpid())])
        Path(f"{barrier}.{rank}.done").touch()
        while not all(Path(f"{barrier}.{r}.done").exists() for r in range(world)) and time.monotonic() < deadline:
            time.sleep(0.05)
    del batches
    return result


def measure_epoch(dataset: str, state_file: str) -> dict[str, Any]:
    import shards

    ds = _open(dataset, "plain")
    from shards.loader.worker_processes import WorkerProcesses
    loader = shards.make_loader(ds, BATCH, mode=WorkerProcesses(2), drop_last=False)
    total = len(loader)
    start = time.monotonic()
    seen = 0
    state = None
    for i, (values, _labels) in enumerate(loader):
        seen += len(values)
        if i + 1 == total // 2:
            state = loader.state_dict()
    seconds = time.monotonic() - start
    assert state is not None
    text = json.dumps(state)
    Path(state_file).write_text(text)
    return {"epoch_s": seconds, "samples": seen, "samples_per_s": seen / seconds, "state_bytes": len(text.encode())}


def measure_resume(dataset: str, state_file: str) -> dict[str, Any]:
    import shards

    _imports()
    state = json.loads(Path(state_file).read_text())
    start = time.monotonic()
    ds = _open(dataset, "plain")
    from shards.loader.worker_processes import WorkerProcesses
    loader = shards.make_loader(ds, 192, mode=WorkerProcesses(3), drop_last=False)
    loader.load_state_dict(state)
    next(iter(loader))
    return {"resume_first_batch_s": time.monotonic() - start}


def run_child(args: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 3 workers on 2 cores, on purpose
    what, dataset, *rest = args
    if what == "open":
        variant, rank, world, barrier = rest
        result = measure_open(dataset, variant, int(rank), int(world), None if barrier == "-" else barrier)
    elif what == "epoch":
        result = measure_epoch(dataset, rest[0])
    elif what == "resume":
        result = measure_resume(dataset, rest[0])
    else:
        raise SystemExit(f"unknown measurement {what}")
    print(json.dumps(result))


def node_of_two(dataset: Path, variant: str) -> dict[str, Any]:
    """Two ranks of one node opening the same variant at once: each one's figures and their PSS summed."""
    with tempfile.TemporaryDirectory() as tmp:
        barrier = str(Path(tmp) / "barrier")
        procs = [subprocess.Popen([sys.executable, __file__, "--child", "open", str(dataset), variant, str(rank), "2",
                                   barrier], stdout=subprocess.PIPE, text=True) for rank in range(2)]
        results = []
        for proc in procs:
            out, _ = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"a rank of the {variant} node run failed ({proc.returncode})")
            results.append(json.loads(out.strip().splitlines()[-1]))
    return {"node_pss_mb": sum(r["pss_mb"] for r in results),
            "node_first_batch_s": max(r["first_batch_s"] for r in results)}


# -- one size ------------------------------------------------------------------------------------------------------
def pick_keys(dataset: Path, count: int = 1000) -> None:
    """``count`` keys spread over the dataset (every n-th line of its source index), for the key list variant;
    written beside the dataset folder, never into it."""
    target = Path(str(dataset) + "." + KEYS_FILE)
    if target.is_file():
        return
    lines = sum(1 for _ in open(dataset / "source-index.jsonl", "rb"))
    step = max(1, lines // count)
    keys = []
    with open(dataset / "source-index.jsonl", "rb") as f:
        for i, line in enumerate(f):
            if i % step == 0 and len(keys) < count:
                row = json.loads(line)
                if row.get("shard"):
                    keys.append(row["key"])
    target.write_text(json.dumps(keys))


def measure_size(files: int, cache: Path, repack: bool, label: str) -> dict[str, Any]:
    dataset, pack_figures = packed(files, cache, repack, label)
    pick_keys(dataset)
    row: dict[str, Any] = {"files": files, "pack_s": pack_figures["seconds"], "pack_max_rss_mb": pack_figures["max_rss_mb"]}
    for variant in VARIANTS:
        log(f"{files:,}: open {variant}")
        single = child("open", str(dataset), variant, "0", "1", "-")
        node = node_of_two(dataset, variant)
        row[variant] = {**single, **node}
    with tempfile.TemporaryDirectory() as tmp:
        state_file = str(Path(tmp) / "state.json")
        log(f"{files:,}: one I/O-only epoch")
        row["epoch"] = child("epoch", str(dataset), state_file)
        log(f"{files:,}: elastic resume")
        row["epoch"].update(child("resume", str(dataset), state_file))
        for workers in (1, 2):
            log(f"{files:,}: verify --workers {workers}")
            row[f"verify_w{workers}_s"] = run_measured([str(BIN / "shards"), "verify", str(dataset), "--workers",
                                                        str(workers), "--quiet"])["seconds"]
        log(f"{files:,}: inspect, report")
        row["inspect_s"] = run_measured([str(BIN / "shards"), "inspect", str(dataset)])["seconds"]
        row["report_s"] = run_measured([str(BIN / "shards"), "report", str(dataset), "--out",
                                        str(Path(tmp) / "report.html"), "--quiet"])["seconds"]
    return row


# -- shards plan -----------------------------------------------------------------------------------------------------
PLAN_SHARD_BYTES = 128 << 20
# (name, arguments): one rank; a node of 8 ranks x 8 workers; the same with a node cache of half the dataset.
PLAN_LAYOUTS = (("1 rank x 8 workers", ["--workers", "8"]),
                ("8 ranks x 8 workers", ["--world-size", "8", "--workers", "8"]),
                ("8 x 8, cache of half", ["--world-size", "8", "--workers", "8", "--cache-local", "--cache-limit"]))


def synthetic_manifest(folder: Path, samples: int, shards: int) -> Path:
    """A ``dataset.json`` of ``samples`` samples in ``shards`` tar shards of ``PLAN_SHARD_BYTES`` (no shard is
    written: the forecast needs only the manifest)."""
    from shards.manifest import DatasetManifest, ShardInfo, SplitInfo
    from shards.provenance import SourceInfo

    folder.mkdir(parents=True, exist_ok=True)
    sizes = [samples * (i + 1) // shards - samples * i // shards for i in range(shards)]
    infos = tuple(ShardInfo(f"train-{i:06d}.tar", n, PLAN_SHARD_BYTES, f"{i:064x}") for i, n in enumerate(sizes))
    classes = tuple(f"c{i:04d}" for i in range(1000))
    counts = tuple(samples * (c + 1) // 1000 - samples * c // 1000 for c in range(1000))
    DatasetManifest(storage="tar", classes=classes, splits={"train": SplitInfo(samples, counts, infos)},
                    source=SourceInfo(kind="generated", root="", files_seen=samples), packing={"seed": 0}).save(folder)
    return folder


def measure_plan(samples: int, shards: int) -> dict[str, Any]:
    """``shards plan`` (2 epochs, batch 256) over the synthetic manifest, each layout in a fresh process."""
    out: dict[str, Any] = {"samples": samples, "shards": shards}
    with tempfile.TemporaryDirectory() as tmp:
        dataset = synthetic_manifest(Path(tmp) / "synthetic", samples, shards)
        half = str(shards * PLAN_SHARD_BYTES // 2)
        for name, extra in PLAN_LAYOUTS:
            argv = [str(BIN / "shards"), "plan", str(dataset), "--epochs", "2", "--batch-size", str(BATCH), "--quiet",
                    *extra, *([half] if extra[-1] == "--cache-limit" else [])]
            log(f"plan {samples:,} samples / {shards:,} shards: {name}")
            out[name] = run_measured(argv)
    return out


def markdown(rows: list[dict[str, Any]], speedup: dict[str, Any] | None) -> str:
    head = "| | " + " | ".join(f"{r['files']:,}" for r in rows) + " |"
    lines = [head, "| --- |" + " --- |" * len(rows)]

    def line(name: str, cell) -> None:
        lines.append(f"| {name} | " + " | ".join(cell(r) for r in rows) + " |")

    line("pack-shards, 2 workers: s / largest process's peak RSS",
         lambda r: f"{r['pack_s']:.0f} s / {r['pack_max_rss_mb']:.0f} MB")
    for variant in VARIANTS:
        line(f"open + first batch, {variant}: s (RSS growth; 2-rank node PSS)",
             lambda r, v=variant: f"{r[v]['first_batch_s']:.2f} s ({r[v]['rss_growth_mb']:+.0f} MB; "
                                  f"{r[v]['node_pss_mb']:.0f} MB)")
    line("one I/O-only epoch: samples/s", lambda r: f"{r['epoch']['samples_per_s']:,.0f}")
    line("state_dict at half an epoch: bytes", lambda r: f"{r['epoch']['state_bytes']:,}")
    line("elastic resume (2 -> 3 workers, batch 256 -> 192): first batch", lambda r: f"{r['epoch']['resume_first_batch_s']:.2f} s")
    line("verify, 1 / 2 workers (ratio)",
         lambda r: f"{r['verify_w1_s']:.1f} / {r['verify_w2_s']:.1f} s ({r['verify_w1_s'] / r['verify_w2_s']:.2f}x)")
    line("inspect / report", lambda r: f"{r['inspect_s']:.1f} / {r['report_s']:.1f} s")
    if speedup:
        lines.append("")
        lines.append(f"pack-shards at {speedup['files']:,} files: 1 worker {speedup['one_worker_s']:.0f} s, 2 workers "
                     f"{speedup['two_workers_s']:.0f} s: **{speedup['speedup']:.2f}x** (largest process's peak RSS "
                     f"{speedup['one_rss_mb']:.0f} / {speedup['two_rss_mb']:.0f} MB)")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20000,200000,1280000", help="comma-separated corpus sizes")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--repack", action="store_true", help="pack again even when a packed dataset is kept")
    parser.add_argument("--pack-speedup", type=int, default=0, metavar="FILES",
                        help="also pack a corpus of FILES with 1 and 2 workers for the ratio")
    parser.add_argument("--label", default="", help="a tag in the packed folders' names (to keep two versions' apart)")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--plan", default="1280000:1280", metavar="SAMPLES:SHARDS",
                        help="the synthetic manifest shards plan is timed on")
    parser.add_argument("--plan-only", action="store_true", help="time only shards plan")
    args = parser.parse_args()
    samples, _, count = args.plan.partition(":")
    plan = measure_plan(int(samples), int(count))
    if args.plan_only:
        table = plan_markdown(plan)
        print(table, file=sys.stderr)
        print(json.dumps({"plan": plan, "cpus": os.cpu_count()}))
        return
    rows = [measure_size(int(size), args.cache, args.repack, args.label) for size in args.sizes.split(",")]
    speedup = pack_speedup(args.pack_speedup, args.cache) if args.pack_speedup else None
    table = markdown(rows, speedup) + "\n\n" + plan_markdown(plan)
    print(table, file=sys.stderr)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    print(json.dumps({"sizes": rows, "pack_speedup": speedup, "plan": plan, "cpus": os.cpu_count()}))


def plan_markdown(plan: dict[str, Any]) -> str:
    lines = [f"| shards plan, {plan['samples']:,} samples in {plan['shards']:,} shards, 2 epochs | s | peak RSS |",
             "| --- | --- | --- |"]
    for name, _ in PLAN_LAYOUTS:
        lines.append(f"| {name} | {plan[name]['seconds']:.2f} | {plan[name]['max_rss_mb']:.0f} MB |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
