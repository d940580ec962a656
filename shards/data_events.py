"""The data events of a run: what happened to the data a run was fed, one JSON object per line.

``<run_dir>/data-events.jsonl`` records layout changes (a start or resume with the loader state it resumed from),
exclusion lists added at resume, quarantined samples and worker restarts (contract of issue 23). Lineage
(``shards lineage``) rebuilds what a step was fed from the run record (``shards.runrecord``) and these events, never
from per-step logs, so the file is append-only and every line is flushed and fsynced before the caller goes on: a run killed at any
moment leaves at most its last line torn, and readers ignore such a line.

A rank other than 0 writes ``data-events.rank<R>.jsonl`` (chosen by the event's ``"rank"``), so no rank waits on
another to record what it saw; ``read_events`` reads all of a run's event files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from shards.atomic import on_disk_full
from shards.door.bounded_read import read_regular_file
from shards.errors import ManifestError
from shards.door.jsonlines import json_lines
from shards.runrecord import EVENTS_FILE

# The kinds of event, and who writes them: the training loop a ``LAYOUT`` at every start and resume (the world size,
# workers, batch size and nodes it feeds the run in, and the loader state it resumed from) and an ``EXCLUDE`` when a
# key list is added; a loader's stall recovery (``shards.loader.watchdog``) a ``RESTART`` and a ``QUARANTINE``; a
# loader's resume audit (``shards.position.audit``) a ``RESUME_AUDIT`` when it has checked the first batches it fed
# after a resume (the audit of the state itself is the resume's layout event's ``"resume_audit"``).
LAYOUT, EXCLUDE, RESTART, QUARANTINE, RESUME_AUDIT = "layout", "exclude", "restart", "quarantine", "resume_audit"
AUDITED = ("ok", "mismatch")  # the results of an audit that compared something
_EVENTS_NAME = re.compile(r"^data-events(\.rank(\d+))?\.jsonl\Z")
MAX_EVENTS_BYTES = 256 << 20  # one event is ~200 bytes: a million events fit; more means the file is not ours

log = logging.getLogger(__name__)
_NOT_EVENT = "not an object with a string 'kind' and a finite 'time'"


def events_path(run_dir: str | os.PathLike, rank: int = 0) -> Path:
    """The file rank ``rank`` appends its events to."""
    name = EVENTS_FILE if rank == 0 else f"data-events.rank{rank}.jsonl"
    return Path(run_dir) / name


def append_event(run_dir: str | os.PathLike, event: dict[str, Any]) -> None:
    """Append ``event`` (which names its ``"kind"``) as one line, flushed and fsynced; ``"time"`` is filled in
    when absent. A torn last line left by a killed writer is closed with a newline first, so it stays one bad line
    instead of swallowing this one; a full disk is a ``DiskFullError`` naming the run folder (the line it tore
    is one such bad line)."""
    if not isinstance(event.get("kind"), str):
        raise ValueError(f"a data event needs a string 'kind', got {event!r}")
    record = {"time": time.time(), **event}
    line = json.dumps(record, sort_keys=True, allow_nan=False) + "\n"
    path = events_path(run_dir, int(record.get("rank") or 0))
    with on_disk_full(run_dir, path.name), open(path, "ab") as handle:
        if handle.tell() > 0:
            with open(path, "rb") as reader:
                reader.seek(-1, os.SEEK_END)
                if reader.read(1) != b"\n":
                    handle.write(b"\n")
        handle.write(line.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def _read_file(path: Path, unreadable: list[str] | None = None) -> list[dict[str, Any]]:
    """The file's events; each line that is not one (but a torn last line) is logged and left out, and said in
    ``unreadable`` when given (``path: line N is not a data event (why)``)."""
    text = read_regular_file(path, limit=MAX_EVENTS_BYTES, error=ManifestError).decode("utf-8", errors="replace")
    last = len(text.splitlines())
    events = []
    for number, value, why in json_lines(text):
        if why is None and _is_event(value):
            events.append(value)
        elif number == last and not text.endswith("\n"):
            continue  # the line a killed writer left torn
        else:
            line = f"{path}: line {number} is not a data event ({why or _NOT_EVENT})"
            log.warning("%s; left out", line)
            if unreadable is not None:
                unreadable.append(line)
    return events


def _is_event(value: Any) -> bool:
    """An event is an object with a string ``kind`` and, when it has one, a finite number of seconds ``time`` (the
    events are merged in time order: a ``NaN`` there would scramble the order silently). The fields each kind
    holds are checked by the reader that uses them (lineage's layouts, the report's quarantines)."""
    if type(value) is not dict or type(value.get("kind")) is not str:
        return False
    stamp = value.get("time", 0.0)
    return type(stamp) in (int, float) and math.isfinite(stamp)


def resume_audits(run_dir: str | os.PathLike) -> dict[str, Any]:
    """How the run's resumes fared in the resume audit, as the run recorded it: ``{"resumes", "audited",
    "mismatches", "messages"}`` (a resume is audited when its state's record was compared with the plan; a
    mismatch is one there or in the first batches fed after it). Fields of another type count as not audited."""
    resumes = [e for e in read_events(run_dir, LAYOUT) if e.get("loader_state")]
    results = [e.get("resume_audit") for e in resumes]
    results = [r for r in results if type(r) is dict and r.get("result") in AUDITED]
    live = [e for e in read_events(run_dir, RESUME_AUDIT) if e.get("result") in AUDITED]
    bad = [r for r in results + live if r["result"] == "mismatch"]
    return {"resumes": len(resumes), "audited": len(results), "mismatches": len(bad),
            "messages": [str(r.get("message"))[:500] for r in bad][:10]}


def read_events(run_dir: str | os.PathLike, kind: str | None = None, *,
                unreadable: list[str] | None = None) -> list[dict[str, Any]]:
    """Every event of the run (of ``kind``, when given), from all its event files, in the order they happened (by
    ``"time"``; a file's own lines keep their order). An absent file is no events; a torn last line is ignored;
    ``unreadable`` (when given) gets one line per other line that is not an event (it may have been any kind)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        return []
    per_file = [_read_file(path, unreadable) for path in sorted(folder.iterdir()) if _EVENTS_NAME.match(path.name)]
    merged = [(event.get("time", 0.0), index, event) for index, events in enumerate(per_file) for event in events]
    # sort on (time, file, line) stably: equal times keep rank 0's file first and each file's own order
    events = [event for _, _, event in sorted(merged, key=lambda item: (item[0], item[1]))]
    return events if kind is None else [event for event in events if event["kind"] == kind]
