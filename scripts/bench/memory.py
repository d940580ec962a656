"""The loader's memory budget measured: an epoch per run mode with and without a budget, each pass in a fresh process.

    .venv/bin/python scripts/bench/memory.py [--quick] [--json OUT]

Per mode (``processes``: ``WorkerProcesses(2)``; ``threads``: ``Threads(2)``; ``mtp``: ``WorkerProcesses(2,
decoders=2)``; ``features``: in process with a feature window and train's prefetch thread) four passes: a
minimal-flight baseline (batch size 1, the smallest budget), the epoch without a budget (a budget far above
anything it holds), with a third of the flight that one measured (at least the smallest that works), and with
the smallest that works (from the one-line refusal of a 1-byte budget). Memory is the process tree's PSS
plus what ``/dev/shm`` holds (batches waiting there are mapped by no process), sampled every 50 ms, measured as a
training run's ``metrics.jsonl`` measures it (``shards.procs.memory.tree_memory_bytes``); a pass's flight is its
peak over the baseline's peak. The
consumer sleeps a simulated step per batch, so queues fill as they do beside a training step. Goals (issue 46):
flight <= 1.05 x budget + 32 MB in every mode, speed >= 0.8x the unbudgeted epoch at a third. Results go to
docs/benchmarks.md ("Memory budget").
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "bench")]

from shards.procs.memory import tree_memory_bytes  # noqa: E402

MIB = 1 << 20
MODES = ("processes", "threads", "mtp", "features")
UNBUDGETED = 64 << 30  # far above what any pass holds: the depths asked


def make_data(root: Path, quick: bool) -> None:
    from tests.helpers import make_shard_dataset
    from tests.train.conftest import write_feature_folder

    per_shard = 64 if quick else 160
    make_shard_dataset(root / "images", shard_sizes={"train": [per_shard] * 4}, size=(192, 192))
    write_feature_folder(root / "feat", shard_sizes={"train": [per_shard * 16] * 4}, classes=("a", "b", "c"),
                         dim=512, dtype=__import__("torch").float32)


def open_pass(data: Path, mode: str, batch: int, memory: int):
    import shards
    from shards.loader.threads import Threads
    from shards.loader.worker_processes import WorkerProcesses
    from shards.loader.in_process import InProcess

    if mode == "features":
        dataset = shards.open_dataset(data / "feat" / "features", "train",
                                      sampling=shards.Sampling(feature_window=1024))
        return shards.make_loader(dataset, batch * 4, mode=InProcess(), memory=memory)
    dataset = shards.open_dataset(data / "images", "train", transform=shards.TransformSpec(preset="train", size=224))
    run = {"processes": WorkerProcesses(2, persistent=False), "threads": Threads(2, prefetch=4),
           "mtp": WorkerProcesses(2, persistent=False, decoders=2)}[mode]
    return shards.make_loader(dataset, batch, mode=run, memory=memory, pin_memory=False)


def one_pass(data: Path, mode: str, batch: int, memory: int, step_s: float) -> dict:
    """One epoch in this process: peak PSS of the tree (MiB), seconds; or the smallest budget a refusal names."""
    from shards.loader.budget import MemoryBudgetError
    from train.prefetch import ThreadPrefetcher

    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], (tree_memory_bytes() or 0) // 1024)
            stop.wait(0.05)

    try:
        loader = open_pass(data, mode, batch, memory)
        batches = ThreadPrefetcher(loader, depth=loader.prefetch_within_budget(2)) if mode == "features" else loader
        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        began = time.perf_counter()
        for _ in batches:
            time.sleep(step_s)
        seconds = time.perf_counter() - began
    except MemoryBudgetError as refused:
        return {"smallest": int(re.search(r"\((\d+) bytes\)", str(refused)).group(1))}
    stop.set()
    return {"peak_mib": peak[0] / 1024, "seconds": seconds}


def run_pass(data: Path, mode: str, batch: int, memory: int, step_s: float) -> dict:
    out = subprocess.run([sys.executable, __file__, "--pass", mode, "--data", str(data), "--batch", str(batch),
                          "--memory", str(memory), "--step", str(step_s)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(data: Path, mode: str, batch: int, step_s: float) -> dict:
    smallest_1 = run_pass(data, mode, 1, 1, step_s)["smallest"]
    baseline = run_pass(data, mode, 1, smallest_1, 0.0)["peak_mib"]
    free = run_pass(data, mode, batch, UNBUDGETED, step_s)
    smallest = run_pass(data, mode, batch, 1, step_s)["smallest"]
    flight = (free["peak_mib"] - baseline) * MIB
    rows = {"baseline_mib": round(baseline, 1), "unbudgeted": {"flight_mib": round(flight / MIB, 1),
                                                              "seconds": round(free["seconds"], 2)}}
    for name, budget in (("third", max(int(flight / 3), smallest)), ("smallest", smallest)):
        got = run_pass(data, mode, batch, budget, step_s)
        held = (got["peak_mib"] - baseline) * MIB
        rows[name] = {"budget_mib": round(budget / MIB, 1), "flight_mib": round(held / MIB, 1),
                      "within_goal": held <= 1.05 * budget + 32 * MIB,
                      "speed": round(free["seconds"] / got["seconds"], 2)}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller corpus (under ~2 minutes)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--pass", dest="one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=32, help="images per batch (features: 4x)")
    parser.add_argument("--memory", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--step", type=float, default=0.2, help="simulated training step per batch, seconds")
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_pass(args.data, args.one, args.batch, args.memory, args.step)))
        return
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        make_data(Path(folder), args.quick)
        for mode in args.modes.split(","):
            results[mode] = measure(Path(folder), mode, args.batch, args.step)
            print(mode, json.dumps(results[mode]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
