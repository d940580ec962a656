"""The training side of lineage: the data events ``shards lineage`` rebuilds a step's samples from, and
``--record-keys``, the keys each step was actually fed, to check it against.

``DataWatch`` writes, at every start and resume, the layout the run is fed in (world size, workers, batch size,
nodes, the loader state it resumed from, the key list it leaves out, copied into the run folder) as a data event
(``shards.data_events``), and sends the loaders' stall recovery (restarts, quarantines) to the same file. With the
run record (``shards.runrecord``: the loader call) that is all ``shards.check.lineage`` reads.

``KeyRecorder`` is ``--record-keys``: one line per step and rank in ``keys.jsonl``. A step trained again after a
resume gets a later line; the last line of a step is what the run kept (``read_recorded_keys``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from shards.atomic import atomic_output, on_disk_full
from shards.data_events import EXCLUDE, LAYOUT, append_event, read_events
from shards.door.bounded_read import read_regular_file
from shards.door.jsonlines import json_lines
from shards.door.shape import as_int, as_list, as_object, as_str, field as get
from shards.errors import ManifestError
from shards.runrecord import KEYS_FILE, kept_keys_name
from shards.select.key_set import read_keys


def keep_keys_file(run_dir: str | os.PathLike, path: str) -> dict[str, Any]:
    """Copy an ``--exclude-keys`` file into the run folder under a name from its sha256 (``exclude-keys-<16 hex>.txt``,
    written once, atomically), so lineage reads the list a layout used even after the original changes:
    ``{"keys_file": name in the run folder, "count": keys, "sha256": of the bytes}``."""
    data = read_regular_file(path)
    digest = hashlib.sha256(data).hexdigest()
    name = kept_keys_name(digest)
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


class DataWatch:
    """Rank 0 records each start's layout; every rank's loaders report their faults into the run folder."""

    def __init__(self, run: Any) -> None:
        self.run = run  # the loop's Run: its config, process context, loaders, plan and state

    def record_layout(self, resumed_loader: dict[str, Any] | None) -> None:
        """Rank 0: the layout this start or resume feeds the run in, and the loader state it resumed from."""
        run = self.run
        loader, folder = run.data.train_loader, run.plan.folder
        where = {"epoch": run.state.epoch + 1, "step": run.state.step, "rank": 0}
        kept = keep_keys_file(folder, run.cfg.data.exclude_keys) if run.cfg.data.exclude_keys else None
        earlier = read_events(folder, LAYOUT)
        if kept is not None and (not earlier or earlier[-1].get("exclude_keys") != kept["keys_file"]):
            append_event(folder, {"kind": EXCLUDE, **where, **kept, "source": run.cfg.data.exclude_keys})
        append_event(folder, {
            "kind": LAYOUT, **where, "loader_state": resumed_loader, "world_size": run.ctx.world_size,
            "num_workers": loader.num_workers, "batch_size": run.cfg.optim.batch_size,
            "nodes": int(loader.dataset.config.nodes), "exclude_keys": kept and kept["keys_file"],
            # the audit of the state resumed from (``shards.position.audit``); ``shards audit`` redoes it
            "resume_audit": loader.resume_audit_result() if resumed_loader is not None else None})

    def watch_loaders(self) -> None:
        """Stall recovery (``--stall-timeout``) writes its stack dumps into the run folder and its restarts and
        quarantines of train samples as data events, stamped with the step whose batch was awaited."""
        run = self.run

        def train_event(event: dict[str, Any]) -> None:
            append_event(run.plan.folder, {**event, "epoch": run.state.epoch + 1, "step": run.state.step + 1,
                                           "rank": run.ctx.rank})

        run.data.train_loader.report_faults(str(run.plan.folder), train_event)
        run.data.val_loader.report_faults(str(run.plan.folder), None)

    def recorder(self) -> "KeyRecorder | None":
        """``--record-keys``: this rank's recorder, or None."""
        return KeyRecorder(self.run.plan.folder, self.run.ctx.rank) if self.run.cfg.run.record_keys else None
