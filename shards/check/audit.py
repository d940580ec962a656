"""``shards audit``: every resume a run folder records, audited again after the fact.

A train-from-shards run writes a layout event at every resume with the loader state it resumed from
(``shards.data_events``), and that state carries the resume audit's record: the keys of the last batches fed and of
the next ones the plan gave (``shards.position.audit``). ``audit_run`` opens the run's train loader again from the run
record, as ``shards lineage`` does (``shards.check.lineage.open_train_loader``, no worker is started), and checks each
recorded state against the plan and the shards as they are now (``Loader.audit_state``), beside what the run itself
found then (the layout event's ``"resume_audit"`` and the check of the first batches fed after each resume).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shards.check.lineage import checked_layout, open_train_loader
from shards.data_events import EVENTS_FILE, LAYOUT, RESUME_AUDIT, read_events
from shards.errors import InputError
from shards.runrecord import RECORD_FILE, RunRecord


def audit_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """``{"run_dir", "resumes", "audited", "mismatches", "not_audited", "unreadable", "results"}``: per resume (in run order) its
    epoch and step, the result now (``"ok"``, ``"mismatch"`` with the line naming the batch and key, ``"not
    audited"`` for a state saved without a record, ``"invalid"`` for a state the loader refuses to read) and what
    the run recorded then. A mismatch recorded by the run itself counts as one too. Each events line that cannot be
    read (it may have been a resume's record) is an ``"unreadable"`` result naming the file and line."""
    folder = Path(run_dir)
    record = RunRecord.read(folder)
    where = str(folder / EVENTS_FILE)
    unreadable: list[str] = []  # a line that is not an event may have been a resume's: the audit cannot vouch
    layouts = read_events(folder, LAYOUT, unreadable=unreadable)
    resumes = [e for e in layouts if type(e.get("step")) is int and e.get("loader_state")]
    unreadable += [f"{where}: the layout event of step {e.get('step')!r:.40} is unreadable (its step is not an "
                   "integer); left out" for e in layouts if type(e.get("step")) is not int and e.get("loader_state")]
    live = [e for e in read_events(folder, RESUME_AUDIT) if e.get("result") == "mismatch"]
    results = []
    for event in resumes:
        layout = checked_layout(event, where)
        kept = layout.get("exclude_keys")
        loader = open_train_loader(record.data, rank=0, world_size=layout["world_size"],
                                   nodes=layout.get("nodes") or 1, workers=layout["num_workers"],
                                   batch_size=layout["batch_size"], exclude_keys=str(folder / kept) if kept else None,
                                   where=str(folder / RECORD_FILE))
        try:
            now = loader.audit_state(layout["loader_state"])
        except InputError as exc:
            now = {"result": "invalid", "message": str(exc)}
        finally:
            loader.close()
        results.append({"epoch": layout["epoch"], "step": layout["step"], **now,
                        "recorded": event.get("resume_audit")})
    for event in live:
        results.append({"epoch": event.get("epoch"), "step": event.get("step"), "result": "mismatch",
                        "message": str(event.get("message")), "recorded": "fed after resume"})
    results += [{"epoch": None, "step": None, "result": "unreadable", "message": line, "recorded": None}
                for line in unreadable]
    failed = [r for r in results if r["result"] in ("mismatch", "invalid")]
    return {"run_dir": str(folder), "resumes": len(resumes),
            "audited": sum(r["result"] in ("ok", "mismatch") for r in results[:len(resumes)]),
            "mismatches": len(failed), "not_audited": sum(r["result"] == "not audited" for r in results),
            "unreadable": len(unreadable), "results": results}
