"""Benchmark: the loader's run modes against the peers (Meta's SPDL included), with img/s, CPU seconds per image and
peak memory, every pass in a fresh process, rounds interleaved.

Run as ``python scripts/bench/loader.py --modes`` (the corpus and the packing are ``loader.py``'s): the same
ImageNet-like JPEGs as an ImageFolder tree and as tar shards. Every pass reads four epochs, the first with the page
cache of its files dropped (``posix_fadvise(DONTNEED)``), and reports:

- ``img_s``: images per second of the cold first epoch, as the consumer sees them;
- ``cpu_ms_per_img``: CPU seconds of the pass's process and the worker processes it started (user + system, from
  ``getrusage``), over the first epoch, per image;
- ``peak_mb``: the largest proportional set size (PSS, so shared pages are counted once) of the process and its
  children, sampled every 200 ms over all epochs (reading ``smaps_rollup`` walks a process's page tables: more
  often, the sampling itself would take a share of the 2 cores);
- ``step_ms``: the mean time between batches in the third and fourth epochs (from each epoch's first batch on), as
  a training loop sees it (data wait plus step): what ``Auto`` minimises, and after its trial the steady state (at
  batch 64 on 2 CPUs the trial, with a runoff, takes about 70 batches: it ends in the second epoch).

Peers, as ``../shared/PEERS.md`` sets them up: torchvision's ImageFolder in a DataLoader and webdataset, both
standard transform (Resize 256, CenterCrop 224, normalised floats) in 2 workers; SPDL 0.8 (``spdl.pipeline``: reads
in a pool of 2 threads, FFmpeg decode + scale + crop in 2, normalised in numpy, ``build(num_threads=2)``) over the
files and over the tars. SPDL and its FFmpeg are not project dependencies: ``scripts/bench/peers.sh`` installs them
into ``.bench-peers/``; without them the SPDL passes are reported absent and left out of the ratios.

shardcache: the fast path (uint8 out, normalised by the consumer: ``_uint8`` passes leave that to a GPU, ``_norm``
do it on this CPU) in each run mode, ``WorkerProcesses(2)``, ``Threads(2)``, ``WorkerProcesses(1, decoders=2)`` and
``Auto(2)``; the standard path (PIL + torchvision, floats from the workers) in processes and threads.

Ratios are taken within each round, so machine noise hits both sides of one ratio: the fast path's best mode against
the best peer (img/s, and CPU per image against the leanest peer), ``Auto``'s steady step time against the best fixed
mode's, the standard path in threads against processes. Two passes of the same mode differ by up to about 8% on
the shared 2-core box, so ``Auto``'s choice is also rated alone: the step of the fixed pass that runs the mode it
chose against the best fixed mode's (``auto_choice_step_vs_best_mode_step``). ``fast_auto0_uint8`` (only when
``--passes`` names it) is ``Auto`` without its runoff, the before of issue 45's runoff. ``fast_autowide_uint8`` and
``fast_autowidenocut_uint8`` (also only when named) run ``Auto`` over half the workers (on 2 CPUs ``Auto(1)``: four
candidates, two decoding one image at a time) with and without cutting a clearly slower candidate short: the
cut's gain is the time of the first two epochs, which hold the trial (``auto_cut_first_two_epochs_speedup``).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / ".bench-peers"  # scripts/bench/peers.sh installs SPDL here

FAST_MODES = ("fast_processes_uint8", "fast_threads_uint8", "fast_mtp_uint8", "fast_auto_uint8")
PEER_PASSES = ("imagefolder", "webdataset", "spdl_files", "spdl_tars")
PASSES = PEER_PASSES + FAST_MODES + ("fast_threads_norm", "fast_processes_norm", "standard_processes",
                                     "standard_threads")
# Run only when --passes names them: Auto without its runoff (the before), and Auto over half the workers (on 2 CPUs
# Auto(1): four candidates, two of them decoding one image at a time) with and without its cut (the before).
EXTRA_PASSES = ("fast_auto0_uint8", "fast_autowide_uint8", "fast_autowidenocut_uint8")


# -- in the pass's own process ---------------------------------------------------------------------------------------
def tree_pss_kb(pid: int) -> int:
    """PSS of ``pid`` and its descendants, in KiB (a process that ended meanwhile counts 0)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


class PeakMemory:
    """The largest PSS of this process tree, sampled every ``interval`` seconds on a daemon thread."""

    def __init__(self, interval: float = 0.2):
        self.peak, self.interval = 0, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss_kb(os.getpid()))
            self._stop.wait(self.interval)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 1024


def cpu_seconds() -> float:
    """User + system seconds of this process, of its children already waited for (``getrusage``) and of those
    still running (``/proc``: persistent worker processes, and ``Auto``'s candidates, live past an epoch's end)."""
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime + live_children_cpu(os.getpid())


def live_children_cpu(pid: int) -> float:
    """User + system seconds of the running descendants of ``pid`` (their own, and their waited children's)."""
    ticks, stack = 0, []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            stack += [int(c) for c in (task / "children").read_text().split()]
    except (OSError, ValueError):
        return 0.0
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


STEADY_FROM = 2  # the first epoch whose steps count as steady: Auto's trial, runoff included, ends in epoch 1


def measure(make_epoch: Callable[[int], Iterator[Any]], files: list[Path], expected: int,
            epochs: int = 4) -> dict[str, float]:
    """``epochs`` epochs of ``make_epoch(epoch)`` (each yields batches ``(inputs, labels)``): the first cold, the
    steps of those from ``STEADY_FROM`` on timed."""
    import loader as bench

    memory = PeakMemory()
    bench.drop_cache(files)
    cpu, start = cpu_seconds(), time.perf_counter()
    seen = sum(len(batch[1]) for batch in make_epoch(0))
    first_s, first_cpu = time.perf_counter() - start, cpu_seconds() - cpu
    if seen != expected:
        raise RuntimeError(f"saw {seen} images in the first epoch, expected {expected}")
    steps, epoch_s = [], [first_s]
    for epoch in range(1, epochs):
        arrivals = [time.perf_counter()]
        for _ in make_epoch(epoch):
            arrivals.append(time.perf_counter())
        epoch_s.append(arrivals[-1] - arrivals[0])
        if epoch >= STEADY_FROM:
            steps += [b - a for a, b in zip(arrivals[1:], arrivals[2:])]  # from the first batch on: no start-up
    return {"images": seen, "img_s": seen / first_s, "cpu_ms_per_img": first_cpu / seen * 1000,
            "peak_mb": memory.stop(), "step_ms": statistics.fmean(steps) * 1000, "epoch_s": epoch_s}


def spdl_epochs(sources: list[Path], tars: bool, workers: int, batch_size: int) -> Callable[[int], Iterator]:
    """SPDL's pipeline as PEERS.md describes it, one per epoch."""
    import numpy as np
    import spdl.io
    from spdl.pipeline import PipelineBuilder

    import loader as bench

    mean = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(1, 3, 1, 1) * 255
    std = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(1, 3, 1, 1) * 255
    # Scale the short side to 256 (torchvision's rounding of the long side), centre-crop 224, rgb24, bilinear.
    scale = ("scale=w='if(lte(iw,ih),256,trunc(256*iw/ih))':h='if(lte(iw,ih),trunc(256*ih/iw),256)':"
             "flags=bilinear,crop=224:224,format=rgb24")

    def decode(item: tuple[bytes, int]) -> tuple[Any, int]:
        return spdl.io.to_numpy(spdl.io.load_image(item[0], filter_desc=scale)), item[1]

    def read_file(path: Path) -> tuple[bytes, int]:
        return path.read_bytes(), bench.CLASSES.index(path.parent.name)

    def read_tar(path: Path) -> list[tuple[bytes, int]]:
        parts: dict[str, dict[str, bytes]] = {}
        with open(path, "rb") as handle:
            for name, data in spdl.io.iter_tarfile(handle.read()):
                stem, _, ext = name.rpartition(".")
                parts.setdefault(stem, {})[ext] = bytes(data)
        return [(p["jpg"], int(p["cls"])) for p in parts.values() if "jpg" in p]

    def each(items: list) -> Iterator:
        yield from items

    def collate(items: list) -> tuple[Any, Any]:
        chw = np.stack([x for x, _ in items]).transpose(0, 3, 1, 2).astype(np.float32)
        return (chw - mean) / std, np.array([label for _, label in items])

    def epoch(number: int) -> Iterator:
        order = np.random.default_rng(number).permutation(len(sources))
        builder = PipelineBuilder().add_source([sources[i] for i in order])
        builder = builder.pipe(read_tar, concurrency=workers).pipe(each) if tars else \
            builder.pipe(read_file, concurrency=workers)
        pipeline = (builder.pipe(decode, concurrency=workers).aggregate(batch_size).pipe(collate)
                    .add_sink(4).build(num_threads=workers))
        with pipeline.auto_stop():
            yield from pipeline
    return epoch


def run_pass(name: str, workdir: Path, workers: int, batch_size: int, count: int) -> dict[str, Any]:
    import torch

    import loader as bench
    import shards
    from shards.loader.auto import Auto
    from shards.loader.threads import Threads
    from shards.loader.worker_processes import WorkerProcesses

    files = bench.build_corpus(workdir / "images", count)
    tars = sorted((workdir / "tar").glob("*.tar"))
    args = type("Args", (), {"workers": workers, "batch_size": batch_size})()
    if name == "imagefolder":
        return measure(lambda e: iter(bench.imagefolder(workdir / "images", args, False)), files, count)
    if name == "webdataset":
        return measure(lambda e: iter(bench.webdataset_loader(workdir / "tar", args, False)), tars, count)
    if name.startswith("spdl_"):
        on_tars = name == "spdl_tars"
        return measure(spdl_epochs(tars if on_tars else files, on_tars, workers, batch_size), tars if on_tars
                       else files, count)
    modes = {"processes": WorkerProcesses(workers, persistent=False), "threads": Threads(workers),
             "mtp": WorkerProcesses(max(1, workers // 2), persistent=False, decoders=2), "auto": Auto(workers),
             "auto0": Auto(workers, runoff_percent=0), "autowide": Auto(max(1, workers // 2)),
             "autowidenocut": Auto(max(1, workers // 2))}
    if name == "fast_autowidenocut_uint8":
        import shards.loader.auto

        shards.loader.auto.CUT_RATIO = float("inf")  # the before: every candidate takes its whole turn
    pipeline, mode, consumer = (name.split("_") + ["uint8"])[:3]
    if pipeline == "fast":
        dataset = shards.open_dataset(workdir / "tar", transform=bench.SPEC, decode=shards.Decode("fast"), seed=0)
        normalize = dataset.normalizer() if consumer == "norm" else torch.nn.Identity()
    else:
        dataset = shards.open_dataset(workdir / "tar", transform=bench.SPEC, seed=0)
        normalize = torch.nn.Identity()
    loader = shards.make_loader(dataset, batch_size, mode=modes[mode], drop_last=False)

    def epoch(number: int) -> Iterator:
        loader.set_epoch(number)
        for images, labels in loader:
            yield normalize(images), labels

    result = measure(epoch, tars, count)
    choice = loader.mode_choice()
    if choice is not None:
        result.update(chosen=choice["chosen"], runoff=choice["runoff"], cut=choice["cut"], trial=choice["trial"])
    loader.close()
    return result


# -- the driver --------------------------------------------------------------------------------------------------------
def spdl_available() -> str | None:
    """None when SPDL and its FFmpeg load, else why not."""
    code = "import spdl.io; spdl.io.utils.get_ffmpeg_versions()"
    result = subprocess.run([sys.executable, "-c", code], env=pass_env(), capture_output=True, text=True)
    if result.returncode == 0:
        return None
    return (result.stderr.strip().splitlines() or ["unknown"])[-1] + " (scripts/bench/peers.sh installs it)"


def pass_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "scripts" / "bench")] + ([str(PEERS_DIR)] if PEERS_DIR.is_dir() else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def one_pass(name: str, args: Any, count: int) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__)), "--one", name, "--workdir", str(args.workdir), "--workers",
               str(args.workers), "--batch-size", str(args.batch_size), "--images", str(count)]
    result = subprocess.run(command, env=pass_env(), capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"pass {name} failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def fixed_pass(chosen: str | None) -> str | None:
    """The fixed-mode pass that runs the mode ``Auto`` chose (None for one no pass runs: a wider decode)."""
    if chosen and "decoders=0" in chosen:
        return {"Threads": "fast_threads_uint8", "WorkerProcesses": "fast_processes_uint8"}.get(chosen.split("(")[0])
    return None


def round_ratios(rates: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One round's ratios (see the module docstring): those whose passes ran this round."""
    ratios: dict[str, Any] = {}
    fixed = [name for name in FAST_MODES if name != "fast_auto_uint8" and name in rates]
    if "fast_processes_uint8" in rates and "fast_threads_uint8" in rates:
        best_fast = max(fixed, key=lambda n: rates[n]["img_s"])
        steadiest = min(fixed, key=lambda n: rates[n]["step_ms"])
        ratios.update(best_fast_mode=best_fast, best_step_mode=steadiest,
                      fast_threads_vs_processes=rates["fast_threads_uint8"]["img_s"]
                      / rates["fast_processes_uint8"]["img_s"])
        for auto in ("fast_auto_uint8", "fast_auto0_uint8"):
            if auto in rates:
                key = "auto" if auto == "fast_auto_uint8" else "auto_without_runoff"
                ratios[f"{key}_step_vs_best_mode_step"] = rates[auto]["step_ms"] / rates[steadiest]["step_ms"]
                ratios[f"{key}_first_epoch_vs_best_mode"] = rates[auto]["img_s"] / rates[best_fast]["img_s"]
                same = fixed_pass(rates[auto].get("chosen"))
                if same in rates:  # the choice alone: its own fixed pass, free of the noise between two passes
                    ratios[f"{key}_choice_step_vs_best_mode_step"] = (rates[same]["step_ms"]
                                                                      / rates[steadiest]["step_ms"])
        peers = {name: r for name, r in rates.items() if name in PEER_PASSES}
        if peers:
            best_peer = max(peers, key=lambda n: peers[n]["img_s"])
            leanest_peer = min(peers, key=lambda n: peers[n]["cpu_ms_per_img"])
            ratios.update(best_peer=best_peer, leanest_peer=leanest_peer,
                          fast_best_mode_vs_best_peer=rates[best_fast]["img_s"] / peers[best_peer]["img_s"],
                          fast_cpu_vs_leanest_peer=rates[best_fast]["cpu_ms_per_img"]
                          / peers[leanest_peer]["cpu_ms_per_img"])
            if "fast_threads_norm" in rates:
                ratios["fast_threads_norm_vs_best_peer"] = (rates["fast_threads_norm"]["img_s"]
                                                            / peers[best_peer]["img_s"])
    if "fast_autowide_uint8" in rates and "fast_autowidenocut_uint8" in rates:  # the cut's gain: the trial's epochs
        cut, whole = (rates[name] for name in ("fast_autowide_uint8", "fast_autowidenocut_uint8"))
        ratios["auto_cut_first_two_epochs_speedup"] = sum(whole["epoch_s"][:2]) / sum(cut["epoch_s"][:2])
        ratios["auto_cut_step_vs_without"] = cut["step_ms"] / whole["step_ms"]
    if "standard_threads" in rates and "standard_processes" in rates:
        ratios["standard_threads_vs_processes"] = (rates["standard_threads"]["img_s"]
                                                   / rates["standard_processes"]["img_s"])
    return ratios


def run_modes(args: Any, count: int, log: Any) -> dict[str, Any]:
    """Every pass once per round, every other round in reverse order; the table and ratios per round."""
    missing = spdl_available()
    chosen = args.passes.split(",") if getattr(args, "passes", None) else PASSES
    unknown = sorted(set(chosen) - set(PASSES) - set(EXTRA_PASSES))
    if unknown:
        raise SystemExit(f"error: unknown pass {unknown[0]!r} (passes: {', '.join(PASSES + EXTRA_PASSES)})")
    passes = [name for name in PASSES + EXTRA_PASSES
              if name in chosen and not (missing and name.startswith("spdl_"))]
    if missing:
        log.warning("SPDL passes left out: %s", missing)
    rounds = []
    for index in range(args.repeat):
        rates = {}
        for name in (passes if index % 2 == 0 else list(reversed(passes))):
            rates[name] = one_pass(name, args, count)
            r = rates[name]
            log.info("round %d %-22s %7.1f img/s %6.2f ms CPU/img %7.0f MB peak %6.1f ms/step%s", index, name,
                     r["img_s"], r["cpu_ms_per_img"], r["peak_mb"], r["step_ms"],
                     f" (chose {r['chosen']})" if r.get("chosen") else "")
        rounds.append({"passes": rates, "ratios": round_ratios(rates)})
        if rounds[-1]["ratios"]:
            log.info("round %d ratios: %s", index, json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                                                for k, v in rounds[-1]["ratios"].items()}))
    return {"spdl": missing or "measured", "rounds": rounds}


def report(result: dict[str, Any]) -> str:
    names = list(result["rounds"][0]["passes"])
    lines = [f"{'pass':<24}" + "".join(f"{'img/s r' + str(i):>11}" for i in range(len(result['rounds'])))
             + f"{'CPU ms/img':>12}{'peak MB':>9}{'ms/step':>9}"]
    for name in names:
        per_round = [r["passes"][name] for r in result["rounds"]]
        lines.append(f"{name:<24}" + "".join(f"{p['img_s']:>11.1f}" for p in per_round)
                     + f"{statistics.median(p['cpu_ms_per_img'] for p in per_round):>12.2f}"
                     + f"{max(p['peak_mb'] for p in per_round):>9.0f}"
                     + f"{statistics.median(p['step_ms'] for p in per_round):>9.1f}")
    for key in ("fast_best_mode_vs_best_peer", "fast_threads_norm_vs_best_peer", "fast_cpu_vs_leanest_peer",
                "auto_step_vs_best_mode_step", "auto_first_epoch_vs_best_mode",
                "auto_choice_step_vs_best_mode_step", "auto_without_runoff_step_vs_best_mode_step",
                "auto_without_runoff_first_epoch_vs_best_mode", "auto_without_runoff_choice_step_vs_best_mode_step",
                "auto_cut_first_two_epochs_speedup", "auto_cut_step_vs_without",
                "standard_threads_vs_processes", "fast_threads_vs_processes"):
        if not all(key in r["ratios"] for r in result["rounds"]):
            continue
        values = [r["ratios"][key] for r in result["rounds"]]
        lines.append(f"{key:<36}" + " ".join(f"{v:6.2f}x" for v in values))
    return "\n".join(lines)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="one pass of the run-mode benchmark (driven by loader.py --modes)")
    parser.add_argument("--one", choices=PASSES + EXTRA_PASSES, required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--images", type=int, default=3000)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    print(json.dumps(run_pass(args.one, args.workdir, args.workers, args.batch_size, args.images)))


if __name__ == "__main__":
    main()
