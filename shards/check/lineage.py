"""``shards lineage``: which samples a training step was fed, computed from the run folder alone.

The run record (``shards.runrecord``: ``run.json``) holds the train loader's ``open_dataset`` and ``make_loader``
calls as plain values; the layout events of ``data-events.jsonl`` (``shards.data_events``) say what each start or
resume changed: the world size, workers, batch size and node count the step ran in, the loader state it resumed
from and the key list it left out. ``run_lineage`` opens the loader of each rank again from the record
(``open_train_loader``, no worker is started), walks epoch by epoch to the step and answers with
``Loader.batch_keys``, the same order function iteration uses (docs/design.md, "The order model"). Nothing per step
is read: a run needs no ``--record-keys``, and nothing from ``train`` is imported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shards.data_events import EVENTS_FILE, LAYOUT, QUARANTINE, read_events
from shards.door.shape import MAX_COUNT, as_int, as_object, as_str, field as get
from shards.errors import InputError, ManifestError
from shards.runrecord import KEPT_KEYS_FILE, MAX_WORLD, RECORD_FILE, DataCall, RunRecord


def _options(call: dict[str, Any], *, rank: int, world_size: int, nodes: int, exclude_keys: str | None,
             where: str) -> tuple[Any, dict[str, Any]]:
    """The recorded call's path (or sources) and keyword arguments as ``open_dataset`` takes them; a record value
    an option refuses is a ``ManifestError`` naming the record."""
    from shards.image.transforms import TransformSpec
    from shards.select.mixture import MixOptions, SourceSpec, Subset
    from shards.stream.options import Decode, Distributed, Remote, Sampling

    try:
        remote = call["remote"]
        kwargs = {"transform": None if call.get("transform") is None else TransformSpec.from_dict(call["transform"]),
                  "seed": call["seed"], "return_keys": call["return_keys"], "sampling": Sampling(**call["sampling"]),
                  "decode": Decode(**call["decode"]),
                  "remote": Remote(base_url=remote.get("base_url"), url_origins=remote.get("url_origins") or (),
                                   storage_options=remote.get("storage_options")),
                  "distributed": Distributed(rank, world_size, nodes=nodes,
                                             rotate_every=call["distributed"].get("rotate_every", 0)),
                  "mix": MixOptions(**call["mix"])}
        if call.get("sources") is None:
            return call["path"], kwargs
        sources = [SourceSpec(s["path"], s.get("weight"), s.get("repeat"), s.get("choose"),
                              Subset(**(s.get("subset") or {}), exclude_keys=exclude_keys), s.get("source"))
                   for s in call["sources"]]
        return sources, kwargs
    except (InputError, TypeError) as exc:  # a ManifestError is an InputError: its reason is kept
        raise ManifestError(f"data.open_dataset: {getattr(exc, 'reason', exc)}", path=where) from None


def _exclude(dataset: Any, path: str, split: str, keys_file: str, storage_options: Any) -> None:
    """Leave the keys of ``keys_file`` out of one whole dataset's every epoch, as training did: found over the
    split's column index when it has one, else from the shards' keys."""
    from shards.select.columns import open_columns
    from shards.select.key_set import read_keys
    from shards.select.selection import excluded_rows
    from shards.transport.location import locate
    from shards.transport.manifest_io import load_manifest_at

    manifest = load_manifest_at(path, storage_options=storage_options)[0]
    columns = None
    if manifest.kind == "images":
        columns = open_columns(locate(path, storage_options=storage_options), manifest, split)
    dataset.exclude_rows(excluded_rows(read_keys(keys_file), columns, dataset))


def open_train_loader(call: DataCall, *, rank: int, world_size: int, nodes: int, workers: int, batch_size: int,
                      exclude_keys: str | None, where: str = RECORD_FILE) -> Any:
    """Rank ``rank``'s train loader as the recorded call made it, in the layout given (no worker is started). Its
    resume audit is off: lineage answers what a step was fed, whatever the audit said (``shards audit`` asks it
    through ``Loader.audit_state``)."""
    import shards

    path, kwargs = _options(call.open_dataset, rank=rank, world_size=world_size, nodes=nodes,
                            exclude_keys=exclude_keys, where=where)
    dataset = shards.open_dataset(path, call.open_dataset["split"], **kwargs)
    if exclude_keys and call.open_dataset.get("sources") is None:
        _exclude(dataset, path, call.open_dataset["split"], exclude_keys, kwargs["remote"].storage_options)
    from shards.loader.loader import workers_mode

    # The loader call in plain values: the run mode its workers count names, as train-from-shards's --workers.
    return shards.make_loader(dataset, batch_size=batch_size, mode=workers_mode(workers),
                              drop_last=call.make_loader["drop_last"], resume_audit="off")


def checked_layout(event: dict[str, Any], where: str) -> dict[str, Any]:
    """A layout event as lineage uses it, each field of its type and range (a ``ManifestError`` naming the events
    file and the field otherwise). The loader state it resumed from is the loader's to check, when it is loaded;
    the exclusion list it names must be a copy the run kept in its folder, never a path elsewhere."""
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
    layouts = [e for e in read_events(folder, LAYOUT) if type(e.get("step")) is int]
    before = [e for e in layouts if e["step"] < step]
    if not before:
        raise InputError(f"no layout event before step {step} in its {EVENTS_FILE} (not a train-from-shards run "
                         "folder, or one that never took a step)", path=str(folder))
    return checked_layout(before[-1], str(folder / EVENTS_FILE))


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
    record = RunRecord.read(folder)
    layout = layout_at(folder, step)
    world = layout["world_size"]
    if rank is not None and not 0 <= rank < world:
        raise InputError(f"--rank {rank}: the step ran on {world} rank(s)")
    quarantined = {e["row"]: str(e.get("key")) for e in read_events(folder, QUARANTINE)
                   if type(e.get("row")) is int and e["row"] >= 0 and type(e.get("step")) is int
                   and e["step"] <= step}
    kept = layout.get("exclude_keys")
    answers = {}
    for one in ([rank] if rank is not None else range(world)):
        loader = open_train_loader(record.data, rank=one, world_size=world, nodes=layout.get("nodes") or 1,
                                   workers=layout["num_workers"], batch_size=layout["batch_size"],
                                   exclude_keys=str(folder / kept) if kept else None,
                                   where=str(folder / RECORD_FILE))
        at_epoch, batch = _walk_to(loader, layout, step, record.epochs)
        if at_epoch + 1 != epoch:
            raise InputError(f"step {step} was taken in epoch {at_epoch + 1}, not epoch {epoch}")
        loader.keep_out(quarantined)
        samples = loader.batch_keys(at_epoch, batch)
        answers[one] = {"keys": [s["key"] for s in samples], "samples": samples}
    if rank is not None:
        return {"epoch": epoch, "step": step, "rank": rank, **answers[rank]}
    return {"epoch": epoch, "step": step, "ranks": {str(r): a for r, a in answers.items()}}
