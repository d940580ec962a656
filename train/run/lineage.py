"""Which samples a training step was fed: computed from a run folder (``shards lineage``), or recorded to check it.

``run_lineage`` rebuilds the run's train loaders from ``config.json`` and the layout events of
``data-events.jsonl`` (``shards.data_events``): the last layout that started before the step says the world size,
workers, batch size and node count the step ran in and the loader state it resumed from; the loader built the way
``train-from-shards`` builds it (``train.data.build_data``) then walks epoch by epoch to the step and answers with
``Loader.batch_keys`` (``shards.position.lineage``). Nothing per step is read: a run needs no ``--record-keys``.

``KeyRecorder`` is ``--record-keys``: the keys each step was actually fed, one line per step and rank in
``keys.jsonl``. A step trained again after a resume gets a later line; the last line of a step is what the run
kept (``read_recorded_keys``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from shards.atomic import atomic_output, on_disk_full
from shards.door.bounded_read import read_regular_file
from shards.select.mixture import read_keys
from shards.data_events import EVENTS_FILE, read_events
from shards.errors import InputError, ManifestError
from shards.door.jsonlines import json_lines
from shards.door.shape import MAX_COUNT, as_int, as_list, as_object, as_str, field as get
from train.config import TrainConfig
from train.data import build_data, prepare_manifest
from train.distributed import DistContext
from train.run.run_dir import CONFIG_FILE, KEYS_FILE, read_run_config

KEPT_KEYS_FILE = re.compile(r"^exclude-keys-[0-9a-f]{16}\.txt$")  # what keep_keys_file names a copy
MAX_WORLD = 1 << 16  # ranks, workers per rank and nodes a recorded layout may name: lineage builds a loader per rank


def keep_keys_file(run_dir: str | os.PathLike, path: str) -> dict[str, Any]:
    """Copy an ``--exclude-keys`` file into the run folder under a name from its sha256 (``exclude-keys-<16 hex>.txt``,
    written once, atomically), so lineage reads the list a layout used even after the original changes:
    ``{"keys_file": name in the run folder, "count": keys, "sha256": of the bytes}``."""
    data = read_regular_file(path)
    digest = hashlib.sha256(data).hexdigest()
    name = f"exclude-keys-{digest[:16]}.txt"
    target = Path(run_dir) / name
    if not target.exists():
        with atomic_output(target) as tmp:
            tmp.write_bytes(data)
    return {"keys_file": name, "count": len(read_keys(path)), "sha256": digest}


class KeyRecorder:
    """Appends ``{"epoch", "step", "rank", "keys"}`` per batch to ``keys.jsonl`` as the batch is handed to the
    step (``O_APPEND``, one write per line, so the ranks' lines never interleave within a line)."""

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.rank, self.run_dir = rank, Path(run_dir)
        self._fd = os.open(self.run_dir / KEYS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def record(self, batches: Any, state: Any) -> "RecordedBatches":
        """``batches`` unchanged (and its ``len``); each one's keys (its third element) written under the step it
        is about to be: ``state`` is the loop's ``TrainState``, read as each batch is handed out."""
        return RecordedBatches(batches, self, state)

    def write(self, epoch: int, step: int, keys: Iterable[str]) -> None:
        line = {"epoch": epoch, "step": step, "rank": self.rank, "keys": list(keys)}
        with on_disk_full(self.run_dir):
            os.write(self._fd, (json.dumps(line) + "\n").encode("utf-8"))

    def close(self) -> None:
        os.close(self._fd)


class RecordedBatches:
    """What ``KeyRecorder.record`` hands the loop: the batches, each recorded as it is taken."""

    def __init__(self, batches: Any, recorder: KeyRecorder, state: Any):
        self.batches, self.recorder, self.state = batches, recorder, state

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches:
            self.recorder.write(self.state.epoch + 1, self.state.step + 1, batch[2])
            yield batch


def read_recorded_keys(run_dir: str | os.PathLike) -> dict[tuple[int, int, int], list[str]]:
    """``(epoch, step, rank) -> keys`` from ``keys.jsonl``, the last line of each step winning. A line that is not
    JSON (the one a killed writer left torn) is left out; one of another shape is a ``ManifestError`` naming it."""
    path = Path(run_dir) / KEYS_FILE
    where = str(path)
    try:
        text = read_regular_file(path, error=ManifestError).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=where) from None
    out = {}
    for number, value, why in json_lines(text):
        if why is not None:
            continue
        line = as_object(value, f"line {number}", where=where)
        at = tuple(as_int(get(line, name, f"line {number}", where=where), f"line {number}: {name}", where=where)
                   for name in ("epoch", "step", "rank"))
        keys = as_list(get(line, "keys", f"line {number}", where=where), f"line {number}: keys", where=where)
        out[at] = [as_str(key, f"line {number}: a key", where=where) for key in keys]
    return out


def _layout(event: dict[str, Any], where: str) -> dict[str, Any]:
    """A layout event as lineage uses it, each field of its type and range (a ``ManifestError`` naming the events
    file and the field otherwise). The loader state it resumed from is the loader's to check, when it is loaded;
    the exclusion list it names must be a copy ``keep_keys_file`` made in the run folder, never a path elsewhere."""
    what = f"layout event of step {event['step']}"
    as_int(event["step"], f"{what}: step", where=where)
    for name, lo, hi in (("epoch", 1, MAX_COUNT), ("world_size", 1, MAX_WORLD), ("num_workers", 0, MAX_WORLD),
                         ("batch_size", 1, MAX_COUNT)):
        as_int(get(event, name, what, where=where), f"{what}: {name}", lo=lo, hi=hi, where=where)
    as_int(get(event, "nodes", what, default=1, where=where), f"{what}: nodes", lo=1, hi=MAX_WORLD, where=where)
    if event.get("loader_state") is not None:
        as_object(event["loader_state"], f"{what}: loader_state", where=where)
    kept = event.get("exclude_keys")
    if kept is not None and not KEPT_KEYS_FILE.match(as_str(kept, f"{what}: exclude_keys", where=where)):
        raise ManifestError(f"{what}: exclude_keys {kept!r} is not a key list this run kept in its folder",
                            path=where)
    return event


def layout_at(folder: Path, step: int) -> dict[str, Any]:
    """The layout event that fed global step ``step``: the last one (in time) written before it was taken."""
    layouts = [e for e in read_events(folder) if e.get("kind") == "layout" and type(e.get("step")) is int]
    before = [e for e in layouts if e["step"] < step]
    if not before:
        raise InputError(f"no layout event before step {step} in its data-events.jsonl (a run started before "
                         "lineage was recorded, or not a train-from-shards run folder)", path=str(folder))
    return _layout(before[-1], str(folder / EVENTS_FILE))


def _train_loader(cfg: TrainConfig, manifest: Any, layout: dict[str, Any], rank: int) -> Any:
    """Rank ``rank``'s train loader in ``layout``, built as the run built it (no worker is started)."""
    kept = layout.get("exclude_keys")
    steering = cfg.replace(workers=layout["num_workers"], batch_size=layout["batch_size"],
                           exclude_keys=str(Path(cfg.out_dir) / kept) if kept else None,
                           cache_images=False, memory_limit=None, cache_dir=None, cache_limit=None,
                           record_keys=False, resume=False, overwrite=False, dry_run=False)
    world = layout["world_size"]
    ctx = DistContext(rank, world, 0, torch.device("cpu"), owns_group=False)
    loader = build_data(steering, manifest, ctx).train_loader
    dataset = loader.dataset
    nodes = layout.get("nodes") or 1
    if dataset.config.nodes != nodes:  # node affinity followed the run's cache, which is not ours to open here
        dataset.config = dataclasses.replace(dataset.config, nodes=nodes)
    return loader


def _walk_to(loader: Any, layout: dict[str, Any], step: int, epochs: int) -> tuple[int, int]:
    """``(epoch, batch in epoch)``, both from 0, of global step ``step`` (from 1) for a loader set up as
    ``layout`` started: its epoch, and the loader state it resumed from (loaded into ``loader``)."""
    state = layout.get("loader_state")
    if state:
        loader.load_state_dict(state)
        epoch, batch = int(state["epoch"]), int(state["batches"])
    else:
        epoch, batch = layout["epoch"] - 1, 0
        loader.set_epoch(epoch)
    taken = layout["step"]
    if len(loader) == 0:  # no step was ever taken in this layout: walking epochs would never reach one
        raise InputError(f"step {step}: the run's train loader in this layout yields no batches")
    while True:
        left = len(loader) - batch
        if step - taken <= left:
            return epoch, batch + step - taken - 1
        taken, epoch, batch = taken + left, epoch + 1, 0
        if epoch >= epochs:
            raise InputError(f"step {step} is past the run's last step ({taken})")
        loader.set_epoch(epoch)


def run_lineage(run_dir: str | os.PathLike, epoch: int, step: int, rank: int | None = None) -> dict[str, Any]:
    """The samples of global step ``step`` (from 1, as ``metrics.jsonl``) in epoch ``epoch`` (from 1) of the run in
    ``run_dir``: for one ``rank``, or every rank's under ``"ranks"``; each sample ``{"key", "shard", "row"}``."""
    if epoch < 1 or step < 1:
        raise InputError(f"--epoch and --step count from 1, got epoch={epoch}, step={step}")
    folder = Path(run_dir)
    cfg = read_run_config(folder / CONFIG_FILE)
    layout = layout_at(folder, step)
    world = layout["world_size"]
    if rank is not None and not 0 <= rank < world:
        raise InputError(f"--rank {rank}: the step ran on {world} rank(s)")
    quarantined = {e["row"]: str(e.get("key")) for e in read_events(folder)
                   if e.get("kind") == "quarantine" and type(e.get("row")) is int and e["row"] >= 0
                   and type(e.get("step")) is int and e["step"] <= step}
    manifest = prepare_manifest(cfg)
    answers = {}
    for one in ([rank] if rank is not None else range(world)):
        loader = _train_loader(cfg, manifest, layout, one)
        at_epoch, batch = _walk_to(loader, layout, step, cfg.epochs)
        if at_epoch + 1 != epoch:
            raise InputError(f"step {step} was taken in epoch {at_epoch + 1}, not epoch {epoch}")
        if quarantined:
            loader.dataset.quarantine = {**getattr(loader.dataset, "quarantine", {}), **quarantined}
        samples = loader.batch_keys(at_epoch, batch)
        answers[one] = {"keys": [s["key"] for s in samples], "samples": samples}
    if rank is not None:
        return {"epoch": epoch, "step": step, "rank": rank, **answers[rank]}
    return {"epoch": epoch, "step": step, "ranks": {str(r): a for r, a in answers.items()}}
