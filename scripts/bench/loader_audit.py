"""Benchmark: what the resume audit costs (``shards.position.audit``, docs/training.md "Resume audit").

Run as ``python scripts/bench/loader.py --audit [--quick] [--repeat N]`` (the corpus and the packing are
``loader.py``'s: ImageNet-like JPEGs in tar shards, the fast path in ``--workers`` worker processes). Measured side
by side with the audit off (``make_loader(resume_audit="off")``):

- ``save_ms``: the first ``state_dict()`` of a loader, mid-epoch (the record: the last batches' key hashes from the
  workers' ring, the next batches' keys from the plan; the key column opened), against the position alone;
  ``resave_ms``: a later one;
- ``resume_ms``: one ``load_state_dict(state)`` into a fresh loader (the record checked against the plan in the
  saved layout), against the load alone;
- ``first_batches_ms``: the check of the first batches fed after a resume (their plan's keys), paid once per resume;
- ``us_per_sample``: what a worker adds per sample (the key's hash into the ring), without noise from loading;
- ``img_s``: fast-path throughput with and without the audit, rounds interleaved;
- each cost as a share of a step: the mean time per batch of the pass without the audit.

The plan's keys come from the split's column index, as ``pack-shards`` writes it (``shards.select.row_keys``): the
corpus gets one in a hard-linked copy of its tar folder. Without one (a dataset packed before it existed) they are
read from the shards; ``without_columns`` prices that. Medians over ``rounds`` saves and resumes, each on a loader
that has handed out a few batches.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import os
import shutil

import shards
from shards.formats.column_writer import write_split_columns
from shards.formats.columns import COLUMNS_KEY, FORMAT
from shards.loader.loader import workers_mode
from shards.manifest import load_dataset_manifest
from shards.position.audit import AUDIT_BATCHES, FedRing, row_keys

SAVED_AFTER = 3  # batches handed out before each save: mid-epoch, the ring holding what it must


def audit_passes(args: Any, workdir: Path, tars: list[Path], fast_batches: Callable) -> dict:
    """The fast path with and without the audit, for ``alternating_rounds``."""
    tar = workdir / "tar"
    return {
        "fast_tar": (lambda: fast_batches(tar, args), tars),
        "fast_tar_noaudit": (lambda: fast_batches(tar, args, resume_audit="off"), tars),
    }


def with_columns(folder: Path) -> Path:
    """``folder``'s shards hard-linked into ``folder``-columns, with the key and label columns ``pack-shards``
    writes (read from the shards in manifest order)."""
    out = folder.with_name(folder.name + "-columns")
    if (out / "dataset.json").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    for path in folder.iterdir():
        if path.is_file() and path.name != "dataset.json":
            os.link(path, out / path.name)
    manifest = load_dataset_manifest(folder)
    plain = shards.open_dataset(folder, return_keys=True, sampling=shards.Sampling(shuffle=False),
                                decode=shards.Decode(decoder=lambda sample, seed: 0))
    rows = [{"key": key, "label": int(label)} for _, label, key in plain]
    entry = write_split_columns(out, "train", lambda: iter(rows), len(rows))
    manifest.replace(extra={**manifest.extra, COLUMNS_KEY: {"format": FORMAT, "splits": {"train": entry}}}).save(out)
    return out


def _loader(folder: Path, args: Any, audit: str) -> Any:
    dataset = shards.open_dataset(folder, transform="eval", decode=shards.Decode("fast"), seed=0)
    return shards.make_loader(dataset, batch_size=args.batch_size, mode=workers_mode(args.workers, persistent=False),
                              drop_last=False, resume_audit=audit)


def save_and_resume(folder: Path, args: Any, audit: str, rounds: int) -> dict[str, float]:
    """Median milliseconds of a save, a resume and the check of the first batches after it, audit ``audit``."""
    saves, resaves, resumes, firsts = [], [], [], []
    for _ in range(rounds):
        loader = _loader(folder, args, audit)
        iterator = iter(loader)
        for _ in range(SAVED_AFTER):
            next(iterator)
        began = time.perf_counter()
        state = loader.state_dict()
        saves.append(time.perf_counter() - began)
        next(iterator)
        began = time.perf_counter()
        loader.state_dict()  # a later save of the same loader: the key column already open
        resaves.append(time.perf_counter() - began)
        del iterator
        loader.close()
        fresh = _loader(folder, args, audit)
        began = time.perf_counter()
        fresh.load_state_dict(state)
        resumes.append(time.perf_counter() - began)
        if audit != "off":  # what the check of each first batch asks the plan for
            began = time.perf_counter()
            for step in range(state["batches"], state["batches"] + AUDIT_BATCHES):
                row_keys(fresh.dataset, fresh.batch_rows(state["epoch"], step))
            firsts.append(time.perf_counter() - began)
        fresh.close()
    result = {"save_ms": statistics.median(saves) * 1e3, "resave_ms": statistics.median(resaves) * 1e3,
              "resume_ms": statistics.median(resumes) * 1e3}
    if firsts:
        result["first_batches_ms"] = statistics.median(firsts) * 1e3
    return result


def us_per_sample(samples: int = 200_000, batch_size: int = 64) -> float:
    """What a worker adds per sample: the slot's key hashed into the ring, against a bare loop, best of three."""
    keys = [f"n{i:08d}_{i % 977:04d}" for i in range(samples)]
    ring = FedRing(1, 16, batch_size)

    def plain() -> None:
        for _ in keys:
            pass

    def recorded() -> None:
        writer = ring.writer(0, 0, batch_size)
        for key in keys:
            writer.slot(key)

    best = {}
    for name, function in (("plain", plain), ("recorded", recorded)):
        times = []
        for _ in range(3):
            began = time.perf_counter()
            function()
            times.append(time.perf_counter() - began)
        best[name] = min(times)
    return (best["recorded"] - best["plain"]) / samples * 1e6


def audit_costs(folder: Path, args: Any, rates: dict[str, float], rounds: int) -> dict[str, Any]:
    """Every number of the module docstring, and each as a share of a step without the audit."""
    indexed = with_columns(folder)
    on, off = save_and_resume(indexed, args, "refuse", rounds), save_and_resume(indexed, args, "off", rounds)
    shard_reads = save_and_resume(folder, args, "refuse", rounds)
    step_ms = args.batch_size / rates["fast_tar_noaudit"] * 1e3
    per_sample = us_per_sample(batch_size=args.batch_size)
    added = {"save_ms": on["save_ms"] - off["save_ms"], "resave_ms": on["resave_ms"] - off["resave_ms"],
             "resume_ms": on["resume_ms"] - off["resume_ms"],
             "first_batches_ms": on["first_batches_ms"], "per_step_ms": per_sample * args.batch_size / 1e3}
    return {"audit_on": {k: round(v, 3) for k, v in on.items()},
            "audit_off": {k: round(v, 3) for k, v in off.items()},
            "added_ms": {k: round(v, 3) for k, v in added.items()},
            "without_columns": {k: round(v, 3) for k, v in shard_reads.items()},
            "step_ms": round(step_ms, 2),
            "share_of_a_step": {k: round(v / step_ms, 4) for k, v in added.items()},
            "us_per_sample": round(per_sample, 3),
            "throughput_ratio": round(rates["fast_tar"] / rates["fast_tar_noaudit"], 4)}


def report(costs: dict[str, Any]) -> str:
    lines = [f"{'':<18}{'audit on':>10}{'audit off':>11}{'added':>9}{'of a step':>11}"]
    for name in ("save_ms", "resave_ms", "resume_ms"):
        lines.append(f"{name:<18}{costs['audit_on'][name]:>10.2f}{costs['audit_off'][name]:>11.2f}"
                     f"{costs['added_ms'][name]:>9.2f}{costs['share_of_a_step'][name]:>11.2%}")
    for name in ("first_batches_ms", "per_step_ms"):
        lines.append(f"{name:<18}{'':>10}{'':>11}{costs['added_ms'][name]:>9.2f}"
                     f"{costs['share_of_a_step'][name]:>11.2%}")
    lines.append("without a column index (keys read from the shards): " + ", ".join(
        f"{k} {v:.1f}" for k, v in costs["without_columns"].items()))
    lines.append(f"step {costs['step_ms']:.1f} ms without the audit; a worker adds {costs['us_per_sample']:.2f} us "
                 f"per sample; throughput with/without {costs['throughput_ratio']:.3f}")
    return "\n".join(lines)
