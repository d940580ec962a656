"""Whether an epoch's data wait makes the input pipeline the bottleneck, and what to change: one rule for the
training log (``train-from-shards`` warns after each epoch) and the run report (``shards report`` on the run's
``metrics.jsonl`` and ``config.json``), so the two never disagree.

- The verdict (``starving``): the loop waited for data more than ``WAIT_WARNING_SHARE`` of the epoch AND at least
  ``WAIT_WARNING_SECONDS``. A share alone misleads on short epochs: a 0.1 s epoch spends most of its time starting
  its workers, and "60% waiting" there is 60 ms no setting gives back.
- The advice names the stage the workers spend most of their time in (read, decode, transform, collate: the
  stage names of ``shards.loader.stage_times``, repeated in ``shards.report.stages`` without torch) and what
  usually fixes it. A node-local cache (``--cache-dir``) or a local copy is suggested only when image shards are
  read over the network every epoch and not cached (``reads_over_network``): local files are local already,
  feature rows stay in memory after their first read, ``--cache-images`` keeps decoded images in memory and
  ``--cache-dir`` already caches.

Pure functions of numbers and flags: no torch, no files, so the report imports it as cheaply as the loop.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from shards.transport.location import locate
from shards.report.stages import LOOP_STAGES, WORKER_STAGES

WAIT_WARNING_SHARE = 0.20
# The wait must also be material in absolute time. Below this, an epoch has at most a second or two to gain from any
# change, and its wait is mostly one-off start-up that no setting removes (forking workers, opening the first
# shards, filling the first batch: tens of milliseconds to about a second). A pipeline that really starves the
# loop waits longer than this within any epoch worth tuning.
WAIT_WARNING_SECONDS = 2.0
# Copying batches to the device above this share of the loop's time is worth a tip of its own.
TO_DEVICE_WARNING_SHARE = 0.10


def starving(share: float, wait_s: float) -> bool:
    """Whether an epoch that waited ``wait_s`` seconds for data, ``share`` of its wall time, was held back by its
    input pipeline: both over ``WAIT_WARNING_SHARE`` and at least ``WAIT_WARNING_SECONDS``."""
    return share > WAIT_WARNING_SHARE and wait_s >= WAIT_WARNING_SECONDS


def reads_over_network(data_kind: str | None, paths: Iterable[str], *, cache_images: bool,
                       cache_dir: str | None) -> bool:
    """Whether every epoch reads image shards over the network (``s3://``, ``http(s)://``, ``pipe:``) uncached: the
    one case where a node-local cache or a local copy helps."""
    return data_kind == "images" and not cache_images and not cache_dir and any(not locate(p).is_local for p in paths)


def dominant_worker_stage(stages: Mapping[str, float] | None) -> tuple[str, float] | None:
    """The worker stage with the most seconds and its share of all worker seconds; None without worker time."""
    if not stages:
        return None
    total = sum(stages.get(name, 0.0) for name in WORKER_STAGES)
    if total <= 0:
        return None
    name = max(WORKER_STAGES, key=lambda stage: stages.get(stage, 0.0))
    return name, stages[name] / total


def _more_workers(workers: int | None) -> str:
    return "add workers (--workers" + ("" if workers is None else f", now {workers}") + ")"


def _stage_tip(stage: str, *, workers: int | None, decode: str | None, network_reads: bool) -> str:
    more_workers = _more_workers(workers)
    if stage == "read":
        if network_reads:
            return ("the shards come slowly over the network: use --cache-dir on node-local disk, or copy the shards "
                    "to a local disk")
        return f"reading is slow: {more_workers}"  # local (or in-memory) data: a cache or a copy changes nothing
    if stage == "collate":
        fewer_bytes = "" if decode == "fast" else "use --decode fast (uint8 batches, a quarter of the bytes), "
        return f"batches are slow to assemble: {fewer_bytes}{more_workers} or a smaller --batch-size"
    fast = "" if decode == "fast" else ", use --decode fast"  # decode or transform: more hands, less work
    return f"{more_workers}{fast}, or train on cached features (precompute-features, then --data features)"


def stage_advice(stages: Mapping[str, Any], *, workers: int | None, decode: str | None = None,
                 network_reads: bool = False) -> list[str]:
    """The stage-specific tips: the largest worker stage with its share, and copying to the device when large."""
    tips = []
    dominant = dominant_worker_stage(stages)
    if dominant is not None:
        name, share = dominant
        tip = _stage_tip(name, workers=workers, decode=decode, network_reads=network_reads)
        tips.append(f"{name} is {share:.0%} of worker time: {tip}")
    loop_total = sum(stages.get(name, 0.0) for name in LOOP_STAGES)
    if loop_total > 0 and stages.get("to_device", 0.0) / loop_total > TO_DEVICE_WARNING_SHARE:
        tips.append(f"to_device is {stages['to_device'] / loop_total:.0%} of the loop's time: use pin_memory / a GPU "
                    "node")
    return tips


def wait_advice(share: float, wait_s: float, *, data_kind: str | None, workers: int | None,
                stages: Mapping[str, Any] | None = None, decode: str | None = None,
                network_reads: bool = False) -> str | None:
    """What to change when the loop starves (``starving``); ``None`` when the data pipeline keeps up.

    ``wait_s``: the epoch's seconds blocked on data, ``share`` their share of its wall time. With ``stages`` (an
    epoch's ``stage_seconds``) the advice names the stage the workers spend most time in; without worker seconds
    it falls back to the tips that usually help for ``data_kind`` ("images", "features", None when unknown).
    ``network_reads`` (``reads_over_network``): only then are a node-local cache and a local copy suggested.
    ``workers``: None when not known (the report of a run that chose its workers itself).
    """
    if not starving(share, wait_s):
        return None
    waited = (f"the training loop waited for data {wait_s:.1f} s, {share:.0%} of the epoch (over "
              f"{WAIT_WARNING_SHARE:.0%} and {WAIT_WARNING_SECONDS:g} s): the data pipeline is the bottleneck")
    tips = stage_advice(stages, workers=workers, decode=decode, network_reads=network_reads) if stages else []
    if tips and dominant_worker_stage(stages) is not None:
        if data_kind == "features":
            tips.append("a larger --batch-size (per-batch overhead dominates a small head)")
        return f"{waited}: " + "; ".join(tips)
    if data_kind != "features":
        tips.append("more --workers" + ("" if workers is None else f" (now {workers})"))
    if data_kind == "images":
        tips.append("train on precomputed features instead of images (precompute-features, then --data features)")
        tips.append("fast JPEG decode at reduced size, or repack with smaller images")
        if network_reads:
            tips.append("--cache-dir on node-local disk, or copy the shards to a local disk")
    if data_kind == "features":
        tips.append("a larger --batch-size (per-batch overhead dominates a small head)")
    return f"{waited}; try: " + "; ".join(tips)
