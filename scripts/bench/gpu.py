#!/usr/bin/env python
"""A GPU check ready to run: where the time goes between JPEG bytes and a GPU model, in at most 6 minutes.

Made for a lent machine with minutes on it (an H100/H200-class GPU, 16 cores, no network, its own Python with
torch and torchvision but without webdataset, simplejpeg, torchcodec or boto3): run from the source tree, nothing
installed. It writes its own corpus (20,000 photo-sized JPEGs, ``scripts/bench/corpus.py``), packs it with
``pack-shards`` and measures, printing one JSON line on stdout per step as it finishes (logs go to stderr):

  env   versions, the GPU, which optional packages import, the JPEG batch decoder in use;
  setup the corpus and ``pack-shards`` (tar, 5% val);
  G1    the backbone's forward ceiling: mobilenet_v2 and resnet50 headless (``FeatureExtractor``, what
        precompute-features runs) on a uint8 batch of 256 already on the device, bf16 autocast, channels_last,
        random weights; and resnet50 under ``torch.compile``;
  G2    decode + resize (256 short side, centre crop 224): batched ``decode_jpeg`` on the device against the CPU
        fast path (``FastEval``) in one process per core;
  G3    ``precompute-features`` end to end (``run_precompute``, ``--decode fast`` and ``device``) and its ratio to G1;
  G4    the data-wait share of ``train-from-shards`` (``train.run.loop.train``) on the images (fast pipeline, resnet50,
        AMP) and on G3's cached features (linear head, a few hundred steps).

Each step runs in a process of its own under a time budget (the sum stays under 6 minutes): a step that runs out
is killed and reported as ``"status": "timeout"``, a step with no budget left as ``"skipped"``, and the next goes
on. ``--quick --device cpu`` shrinks everything to run in the test suite (tests/ops/test_gpu_script.py). How to
run it on a lent machine and read its lines: docs/gpu.md.

    PYTHONPATH=. python3 scripts/bench/gpu.py                     # on the GPU machine, from the source tree
    PYTHONPATH=. python3 scripts/bench/gpu.py --steps G1,G3       # env and setup run when a step needs them
    .venv/bin/python scripts/bench/gpu.py --quick --device cpu    # here, about a minute
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

# Run as a file, Python puts this folder first on sys.path, where train.py would shadow the ``train`` package:
# the source tree goes there instead, and sibling scripts are loaded by path (``_sibling``).
ROOT = Path(__file__).resolve().parents[2]
_HERE = str(Path(__file__).resolve().parent)
sys.path[:] = [str(ROOT)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

log = logging.getLogger("bench.gpu")

STEPS = ("env", "setup", "G1", "G2", "G3", "G4")
NEEDS_DATA = {"G2", "G3", "G4"}
# Seconds each step may take at most (full run, quick run); every step also stops at the total budget.
STEP_BUDGET = {"env": (30, 30), "setup": (75, 40), "G1": (110, 40), "G2": (65, 35), "G3": (80, 50),
               "G4": (80, 50)}
TOTAL_BUDGET = (350, 200)  # 6 minutes less a margin for the last process to go
MIN_STEP_S = 8  # a step with less left than this is skipped, not started
OPTIONAL = ("simplejpeg", "torchcodec", "webdataset", "boto3", "pyarrow", "h5py")


class Settings:
    """Sizes of one run, full or ``--quick``; rebuilt from the same arguments in every step's process."""

    def __init__(self, args: argparse.Namespace):
        quick = args.quick
        self.quick, self.device_name, self.workdir = quick, args.device, Path(args.workdir)
        self.images = args.images or (200 if quick else 20_000)
        self.classes = 4 if quick else 100
        self.image_size = (160, 120) if quick else (500, 375)  # stored JPEGs: width, height
        self.workers = args.workers or (2 if quick else len(os.sched_getaffinity(0)))  # the cores this job has
        self.batch = 8 if quick else 256
        self.resize, self.crop = (73, 64) if quick else (256, 224)
        self.models = ("mobilenet_v2",) if quick else ("mobilenet_v2", "resnet50")
        self.compile = not quick and not args.no_compile
        self.backbone = "mobilenet_v2" if quick else "resnet50"
        self.min_seconds = 0.5 if quick else 4.0  # per timed rate: repeat until at least this long
        self.decode_images = 32 if quick else 4096  # G2's sample of the corpus
        self.train_epochs, self.feature_epochs = (1, 2) if quick else (2, 4)

    @property
    def dataset(self) -> Path:
        return self.workdir / "dataset"

    def features(self, decode: str) -> Path:
        return self.workdir / f"features-{decode}"


def emit(record: dict) -> None:
    """One JSON line on stdout, flushed: what the parent relays and a reader collects."""
    print(json.dumps(record, sort_keys=True), flush=True)


# -- steps (each runs in a process of its own) -----------------------------------------------------------------------

def step_env(s: Settings) -> dict:
    import torch
    import torchvision

    from shards.jobs.devices import resolve_device
    from shards.image.device import jpeg_backend

    device = resolve_device(s.device_name)
    return {"python": sys.version.split()[0], "torch": torch.__version__, "torchvision": torchvision.__version__,
            "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cuda": torch.version.cuda, "cpu_count": len(os.sched_getaffinity(0)), "workers": s.workers,
            "importable": {name: _importable(name) for name in OPTIONAL},
            "jpeg_backend": jpeg_backend(), "quick": s.quick, "images": s.images}


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that hides the package says so by raising
        return False


def _sibling(name: str):
    """A script of this folder as a module, loaded by its path (``scripts`` is no package, and another
    distribution's ``scripts`` on the path must not stand in for it)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def photo_jpegs(size: tuple[int, int]):
    """``make_images(count, seed)`` for ``corpus()``: photo-like JPEGs (colour fields plus grain) of ``size``."""
    def make(count: int, seed: int) -> list[bytes]:
        import numpy as np

        make_image = _sibling("pack").make_image
        rng = np.random.default_rng(seed)
        return [make_image(rng, *size) for _ in range(count)]
    return make


def _corpus(s: Settings) -> Path:
    """The ImageFolder corpus of this run's size, written on first use (``scripts/bench/corpus.py``)."""
    return _sibling("corpus").corpus(s.images, s.classes, seed=0, cache=s.workdir, quiet=True, kind="photo",
                                     make_images=photo_jpegs(s.image_size))


def step_setup(s: Settings) -> dict:
    from preprocess.pack.packer import PackConfig, pack

    started = time.perf_counter()
    source = _corpus(s)
    corpus_s = time.perf_counter() - started
    started = time.perf_counter()
    result = pack(PackConfig(str(source), str(s.dataset), val_fraction=0.05, verify="header", workers=s.workers,
                             overwrite=True, quiet=True))
    pack_s = time.perf_counter() - started
    manifest = result.manifest
    shard_bytes = sum(shard.bytes for split in manifest.splits.values() for shard in split.shards)
    return {"images": s.images, "jpeg_side": list(s.image_size), "corpus_s": round(corpus_s, 2),
            "pack_s": round(pack_s, 2), "pack_files_per_s": round(s.images / pack_s, 1),
            "shards": sum(len(split.shards) for split in manifest.splits.values()),
            "splits": {name: split.samples for name, split in manifest.splits.items()},
            "mean_jpeg_bytes": round(shard_bytes / s.images)}


def _rate(run_batch, images_per_call: int, min_seconds: float, sync) -> float:
    """Images/s of ``run_batch()`` repeated for at least ``min_seconds`` (and 3 calls), after one warm-up call."""
    run_batch()
    sync()
    calls, started = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - started < min_seconds:
        run_batch()
        calls += 1
    sync()
    return images_per_call * calls / (time.perf_counter() - started)


def _sync(device):
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def step_g1(s: Settings, deadline: float) -> dict:
    import torch

    from preprocess.features.backbones import build_backbone
    from preprocess.features.featurize import FeatureExtractor
    from shards.image.transforms import TransformSpec
    from shards.jobs.devices import resolve_device
    from shards.image.options import IMAGENET_MEAN, IMAGENET_STD

    device = resolve_device(s.device_name)
    amp = "bf16" if device.type == "cuda" else "off"
    spec = TransformSpec(preset="eval", size=s.crop, resize_size=s.resize, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    images = torch.randint(0, 256, (s.batch, 3, s.crop, s.crop), dtype=torch.uint8, device=device)
    runs = [(name, False) for name in s.models] + ([("resnet50", True)] if s.compile else [])
    models: dict[str, dict] = {}
    for name, compiled in runs:
        label = f"{name}_compiled" if compiled else name
        if compiled and deadline - time.time() < 60:
            models[label] = {"skipped": "less than 60 s of the step's budget left for compiling"}
            continue
        extractor = FeatureExtractor(build_backbone(name, "none", seed=0), spec, device, amp, "float16", s.batch)
        models[label] = {}
        if compiled:
            extractor.model = torch.compile(extractor.model)
            started = time.perf_counter()
            try:
                extractor(images)  # the compile itself, timed apart from the rate
            except Exception as exc:  # no C compiler or triton on the machine: the eager figures still count
                models[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                emit({"step": "G1", "status": "progress", "model": label, **models[label]})
                continue
            models[label]["compile_s"] = round(time.perf_counter() - started, 1)
        models[label]["images_per_s"] = round(_rate(lambda: extractor(images), s.batch, s.min_seconds,
                                                    _sync(device)), 1)
        emit({"step": "G1", "status": "progress", "model": label, **models[label]})
    return {"device": str(device), "amp": amp, "channels_last": device.type == "cuda", "batch": s.batch,
            "input": f"uint8 [{s.batch}, 3, {s.crop}, {s.crop}] on the device, Normalize included",
            "models": models}


_CPU_DATAS: list[bytes] = []  # G2's sample, inherited by the forked decode processes (not pickled to each)


def _cpu_decode(job: tuple[int, int, list[int]]) -> int:
    from shards.image.fast import FastEval

    resize, crop, indices = job
    geometry = FastEval(resize, crop)
    for i in indices:
        geometry(_CPU_DATAS[i])
    return len(indices)


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)  # one core per process: the processes are the parallelism


def step_g2(s: Settings) -> dict:
    import multiprocessing

    import torch

    from shards.jobs.devices import resolve_device
    from shards.image import fast
    from shards.image.batch_crops import eval_crops
    from shards.image.device import decode_images, exif_orientation, jpeg_backend, resize_center_crop

    files = sorted(_corpus(s).glob("*/*.jpg"))[:s.decode_images]
    _CPU_DATAS[:] = [path.read_bytes() for path in files]
    count = len(_CPU_DATAS)
    chunks = [(s.resize, s.crop, list(range(i, min(count, i + 16)))) for i in range(0, count, 16)]
    # The CPU side first, before this process touches CUDA (forking after CUDA starts is unsafe).
    with multiprocessing.get_context("fork").Pool(s.workers, initializer=_one_thread) as pool:
        cpu_rate = _rate(lambda: sum(pool.map(_cpu_decode, chunks)), count, s.min_seconds, lambda: None)
    device = resolve_device(s.device_name)
    sync = _sync(device)
    batches = [_CPU_DATAS[i:i + s.batch] for i in range(0, count, s.batch)]

    def decode(resize: str | None) -> None:
        for batch in batches:
            orientations = [exif_orientation(data) for data in batch]
            images = decode_images(batch, ["jpg"] * len(batch), orientations, device)
            if resize == "per_image":
                torch.stack([resize_center_crop(image, s.resize, s.crop) for image in images])
            elif resize == "batched":  # one roi_align per batch (shards.image.batch_crops), what precompute runs
                eval_crops(images, s.resize, s.crop)

    decode_rate = _rate(lambda: decode(None), count, s.min_seconds, sync)
    decode_resize_rate = _rate(lambda: decode("batched"), count, s.min_seconds, sync)
    per_image_rate = _rate(lambda: decode("per_image"), count, s.min_seconds, sync)
    sample = _CPU_DATAS[:16]
    on_device = decode_images(sample, ["jpg"] * len(sample), [exif_orientation(d) for d in sample], device)
    device_inputs = eval_crops(on_device, s.resize, s.crop).cpu()
    cpu_inputs = torch.stack([fast.FastEval(s.resize, s.crop)(data) for data in sample])
    return {"images": count, "cpu_processes": s.workers,
            "cpu_decoder": "simplejpeg" if fast.simplejpeg is not None else "pil",
            "cpu_fast_images_per_s": round(cpu_rate, 1), "device": str(device), "jpeg_backend": jpeg_backend(),
            "device_decode_images_per_s": round(decode_rate, 1),
            "device_decode_resize_images_per_s": round(decode_resize_rate, 1),
            "device_decode_resize_per_image_images_per_s": round(per_image_rate, 1),
            "device_resize_vs_decode": round(decode_resize_rate / decode_rate, 3),
            "device_vs_cpu": round(decode_resize_rate / cpu_rate, 3),
            "device_vs_cpu_mean_abs_gray_levels": round(float((device_inputs.float() - cpu_inputs.float())
                                                              .abs().mean()), 3)}


def _precompute(s: Settings, decode: str, device_share: float = 1.0) -> dict:
    from preprocess.features.featurize import FeatureConfig, run_precompute

    folder = s.features(decode if device_share == 1.0 else "shared")
    cfg = FeatureConfig(s.dataset, folder, backbone=s.backbone, weights="none", resize=s.resize, crop=s.crop,
                        batch_size=s.batch, workers=s.workers, device=s.device_name, decode=decode,
                        device_share=device_share, overwrite=True, quiet=True,
                        # a random-init small backbone's features underflow float16 to all zeros, which the
                        # degenerate-feature check refuses; the quick run checks the plumbing, not the storage type
                        **({"dtype": "float32"} if s.quick else {}))
    summary = run_precompute(cfg)[1]
    kept = ("images", "seconds", "images_per_s", "data_wait_share", "decode", "decode_share")  # the last: auto's
    return {key: summary[key] for key in kept if key in summary}


def _forward_rate(results: dict, model: str) -> float | None:
    """G1's eager rate of ``model``: from its result, or from its progress lines when G1 ran out of time."""
    g1 = results.get("G1", {})
    found = [g1.get("models", {}).get(model, {})] + [p for p in g1.get("progress", []) if p.get("model") == model]
    return next((record["images_per_s"] for record in found if record.get("images_per_s")), None)


def device_share(workers_rate: float, device_rate: float, forward: float) -> float:
    """The share of decoding to give the device so that the model is fed at its rate, from measured rates.

    The workers decode the rest (``1 - share``) at ``workers_rate`` while the main process decodes ``share`` on the
    device and runs the model; ``--decode device`` alone costs the main process ``1 / device_rate`` per image, of
    which ``1 / forward`` is the model. Both sides take as long when ``(1 - share) / workers_rate = share * decode
    + 1 / forward``.
    """
    decode = max(1.0 / device_rate - 1.0 / forward, 1e-9)
    share = (1.0 / workers_rate - 1.0 / forward) / (1.0 / workers_rate + decode)
    return round(min(1.0, max(0.0, share)), 2)


def step_g3(s: Settings, results: dict) -> dict:
    forward = _forward_rate(results, s.backbone)
    out: dict = {"backbone": s.backbone, "batch": s.batch, "workers": s.workers,
                 "g1_images_per_s": forward}
    for decode in ("fast", "device", "shared", "auto"):  # auto: the share measured and re-measured by the run
        if decode == "shared":
            # The quick run's rates are a busy CPU's: a fixed half only proves the path.
            share = 0.5 if s.quick else device_share(out["fast"]["images_per_s"], out["device"]["images_per_s"],
                                                     forward or float("inf"))
            if not 0.05 <= share <= 0.95:
                out[decode] = {"device_share": share, "skipped": "one side alone feeds the model as well"}
                continue
            run = {"device_share": share, **_precompute(s, "device", share)}
        else:
            run = _precompute(s, decode)
        if forward:
            run["vs_g1"] = round(run["images_per_s"] / forward, 3)
        out[decode] = run
        emit({"step": "G3", "status": "progress", "part": decode, **run})
    return out


def _train(s: Settings, name: str, data_path: str, fields: dict) -> dict:
    import torch

    from train.config import TrainConfig
    from train.run.loop import train
    from shards.runrecord import read_rows

    cuda = s.device_name != "cpu" and torch.cuda.is_available()
    cfg = TrainConfig.of(data_path, str(s.workdir / name),
                         {"run.device": s.device_name, "optim.batch_size": s.batch, "optim.amp": cuda,
                          "run.quiet": True, "run.report": False, "run.overwrite": True, "optim.seed": 0, **fields})
    started = time.perf_counter()
    summary = train(cfg)
    rows = [row.to_json() for row in read_rows(Path(cfg.run.out_dir) / "metrics.jsonl")]
    return {"steps": summary["steps"], "seconds": round(time.perf_counter() - started, 2),
            "epochs": [{"samples_per_s": round(row["samples_per_s"], 1),
                        "data_wait_share": round(row["data_wait_share"], 4)} for row in rows],
            "data_wait_share": round(rows[-1]["data_wait_share"], 4)}  # the last epoch: workers warm, cache warm


def step_g4(s: Settings) -> dict:
    out: dict = {}
    out["images"] = {"model": s.backbone, **_train(s, "run-images", str(s.dataset),
                                                   {"model.name": s.backbone, "loader.image_size": s.crop,
                                                    "optim.epochs": s.train_epochs, "loader.workers": s.workers})}
    emit({"step": "G4", "status": "progress", "part": "images", **out["images"]})
    if not (s.features("fast") / "features.json").is_file():
        _precompute(s, "fast")  # G3 did not run: make the cache it would have made
    out["features"] = {"head": "linear", **_train(s, "run-features", str(s.features("fast")),
                                                  {"optim.epochs": s.feature_epochs})}
    return out


def run_step(name: str, s: Settings, deadline: float) -> dict:
    results_file = s.workdir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    if name == "env":
        return step_env(s)
    if name == "setup":
        return step_setup(s)
    if name == "G1":
        return step_g1(s, deadline)
    if name == "G2":
        return step_g2(s)
    if name == "G3":
        return step_g3(s, results)
    return step_g4(s)


def child(args: argparse.Namespace) -> int:
    """One step in this process: its JSON line on stdout, an error as a JSON line and exit code 1."""
    from shards.jobs.progress import setup_logging

    setup_logging(quiet=True)
    s = Settings(args)
    if s.quick:
        import torch

        torch.set_num_threads(1)  # the quick run shares a small machine: idle threads spinning there cost 10x
    started = time.perf_counter()
    try:
        record = run_step(args.run_step, s, args.deadline)
    except Exception as exc:  # a benchmark step reports its failure and lets the next step run
        traceback.print_exc(file=sys.stderr)
        emit({"step": args.run_step, "status": "error", "error": f"{type(exc).__name__}: {exc}",
              "seconds": round(time.perf_counter() - started, 2)})
        return 1
    emit({"step": args.run_step, "status": "ok", "seconds": round(time.perf_counter() - started, 2), **record})
    return 0


# -- the parent: runs each step in its own process, under the budget --------------------------------------------------

def _relay(stream, lines: list[dict]) -> None:
    """Pass the child's JSON lines on to stdout as they come; anything else a library printed goes to stderr."""
    for line in stream:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            print(line, end="", file=sys.stderr, flush=True)
            continue
        lines.append(record)
        print(line, end="", flush=True)


def _launch(args: argparse.Namespace, step: str, limit: float) -> tuple[list[dict], str | None]:
    """Run ``step`` in a child process for at most ``limit`` seconds; its JSON lines, and why it failed if it did."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--run-step", step, "--workdir", str(args.workdir),
            "--device", args.device, "--deadline", str(time.time() + limit)]
    for option in ("images", "workers"):
        if getattr(args, option):
            argv += [f"--{option}", str(getattr(args, option))]
    argv += ["--quick"] * args.quick + ["--no-compile"] * args.no_compile
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # A session of its own: a timeout kills the step with its DataLoader workers and compile processes.
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    lines: list[dict] = []
    relay = threading.Thread(target=_relay, args=(process.stdout, lines), daemon=True)
    relay.start()
    try:
        process.wait(timeout=limit)
    except BaseException as exc:  # out of time, or the user's Ctrl-C: the step goes, with what it started
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        relay.join(5)
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return lines, "timeout"
    relay.join(5)
    return lines, None if process.returncode == 0 else f"exit code {process.returncode}"


def parent(args: argparse.Namespace) -> int:
    chosen = [step.strip() for step in args.steps.split(",") if step.strip()]
    unknown = sorted(set(chosen) - set(STEPS))
    if unknown:
        print(f"gpu.py: unknown step(s) {unknown}; choose from {list(STEPS)}", file=sys.stderr)
        return 2
    wanted = {"env", *chosen} | ({"setup"} if NEEDS_DATA & set(chosen) else set())
    steps = [step for step in STEPS if step in wanted]
    started = time.time()
    total = TOTAL_BUDGET[args.quick] if args.budget is None else args.budget
    results: dict[str, dict] = {}
    failed = 0
    for step in steps:
        left = started + total - time.time()
        limit = min(STEP_BUDGET[step][args.quick], left)
        if limit < MIN_STEP_S or (step in NEEDS_DATA and results.get("setup", {}).get("status") != "ok"):
            why = "the time budget is spent" if limit < MIN_STEP_S else "setup did not finish"
            results[step] = {"step": step, "status": "skipped", "reason": why}
            emit(results[step])
            failed += 1
            continue
        (args.workdir / "results.json").write_text(json.dumps(results))
        lines, problem = _launch(args, step, limit)
        finals = [line for line in lines if line.get("step") == step and line.get("status") != "progress"]
        record = finals[-1] if finals and problem != "timeout" else None  # the child's own line, relayed
        if record is None:
            if problem == "timeout":
                record = {"step": step, "status": "timeout", "budget_s": round(limit, 1),
                          "progress": [line for line in lines if line.get("status") == "progress"]}
            else:
                record = {"step": step, "status": "error", "error": problem or "no result line"}
            emit(record)
        results[step] = record
        failed += results[step].get("status") != "ok"
    emit({"step": "done", "status": "ok" if not failed else "incomplete", "seconds": round(time.time() - started, 1),
          "steps": {step: results.get(step, {}).get("status", "skipped") for step in steps}})
    return 0 if not failed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="G1,G2,G3,G4", help=f"comma-separated, from {','.join(STEPS[2:])}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (200 images, batch 8, mobilenet only)")
    parser.add_argument("--device", default="auto", help="auto, cuda, cuda:N or cpu")
    parser.add_argument("--images", type=int, default=None, help="corpus size (default 20000; quick 200)")
    parser.add_argument("--workers", type=int, default=None, help="CPU processes (default: every core; quick 2)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for all steps (default {TOTAL_BUDGET[0]}; quick {TOTAL_BUDGET[1]})")
    parser.add_argument("--no-compile", action="store_true", help="leave out G1's torch.compile run")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed after")
    parser.add_argument("--run-step", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_step:
        return child(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    keep = args.workdir is not None
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardcache-gpu-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    log.info("work folder %s", args.workdir)
    try:
        return parent(args)
    finally:
        if not keep:
            import shutil

            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
