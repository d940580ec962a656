"""The loader's side of the resume audit (``shards.position.audit``): which batch it handed out when, the audit
record it saves, the check of a state it loads, and the check of the first batches it feeds after a resume.

The loader counts the batches it hands out itself (``handed``), apart from the cursor's arithmetic, so the saved
``through`` and the steps of the ``fed`` batches are what was fed, not what the position says. Where each handed
batch's keys are depends on the run mode, and each is taken from the batch as it was made:

- a stream (``WorkerProcesses``, ``Threads``, ``InProcess`` over images, and ``Auto``, which runs those): each
  logical worker records the key of every slot it reads into the loader's ``FedRing`` as it reads it, in its own
  process or thread; the main process finds a handed batch's entry by the DataLoader's round robin (the worker and
  its batch number) and takes it only if the ring still holds all of it;
- gathered feature batches (``InProcess`` over features): the run hands over the row indices it gathered the batch
  from (``gathered``) and the keys are read for those rows from the shards when a state is saved.

On load the record is checked against the plan in the saved layout (``check_state``) before anything changes; a
mismatch refuses the state (``"refuse"``), logs one line (``"warn"``), or nothing is checked (``"off"``: no record
either). The first ``AUDIT_BATCHES`` batches fed after the resume are then compared with the plan of the layout that
continues it (``Loader.batch_keys``), which catches an error in the resume itself (a worker's skip, its rotation)
at the first batch instead of epochs later.
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from dataclasses import replace
from typing import Any, Callable, Iterator

import numpy as np

from shards.data_events import RESUME_AUDIT as AUDIT_EVENT
from shards.errors import InputError
from shards.order.plan import round_robin_consumed, worker_sample_counts
from shards.position.audit import (
    AUDIT, AUDIT_BATCHES, AUDIT_SLOTS, MISMATCH, NOT_AUDITED, OFF, OK, AuditBatch, AuditRecord, FedRing,
    ResumeAuditError, first_mismatch, key_hashes, mismatch_line, row_keys,
)
from shards.position.elastic import SavedState
from shards.position.lineage import batch_rows
from shards.position.resume import LoaderState, check_compatible, worker_batches

log = logging.getLogger(__name__)

RING_SPARE = 8  # ring entries beyond the batches a mode makes ahead: a trainer's own prefetch lags a little
MAX_RING = 64


def plan_keys(dataset: Any, source: Any, position: LoaderState | SavedState, rank: int, step: int) -> list[str]:
    """The keys the plan puts in batch ``step`` of ``rank`` in ``position``'s layout, read from the shards now."""
    return row_keys(dataset, batch_rows(source, position, rank, step))


def check_state(loader: Any, state: SavedState) -> dict[str, Any]:
    """The audit of saved ``state`` (parsed at the door) against ``loader``'s dataset and plan, without loading it:
    ``{"result": "ok", "batches": n}``, ``{"result": "mismatch", "message": one line}`` or ``{"result": "not
    audited", "reason"}``. A state of another dataset or order settings is an ``InputError`` as ``load_state_dict``
    raises it (a malformed one was refused at the door)."""
    record = state.audit
    if record is None:
        return {"result": NOT_AUDITED, "reason": "the state carries no audit record (saved before the audit, or "
                                                 "with resume_audit='off')"}
    saved = state.position
    check_compatible(saved, loader.cursor.position(0))
    if record.rank >= saved.world_size:
        raise InputError(f"loader state audit.rank is {record.rank}: the state's world size is {saved.world_size}")
    dataset = loader.dataset
    source = replace(dataset.epoch_source(), excluded=state.excluded)
    checks: list[tuple[AuditBatch, str]] = [(b, "the batch fed") for b in record.fed]
    checks += [(b, "the batch recorded to come next") for b in record.next]
    if record.through != saved.batches:
        at = min(record.through, saved.batches)
        checks.append((AuditBatch(at, 0, np.zeros(0, dtype=np.int64)), "through"))
    for batch, what in sorted(checks, key=lambda item: item[0].step):
        try:
            keys = plan_keys(dataset, source, state, record.rank, batch.step)
        except InputError as exc:
            return _mismatch(f"resume audit: epoch {saved.epoch + 1}, batch {batch.step + 1} of the epoch: the "
                             f"record names a batch the plan does not have ({exc.reason})")
        if what == "through":
            first = f" (its first key: {keys[0]!r})" if keys else ""
            return _mismatch(f"resume audit: epoch {saved.epoch + 1}, batch {batch.step + 1} of the epoch{first}: "
                             f"the state resumes after {saved.batches} batches but its loader had handed out "
                             f"{record.through}")
        found = first_mismatch(batch, keys)
        if found is not None:
            return _mismatch(mismatch_line(saved.epoch, batch.step, found[0], found[1], what, batch.size))
    return {"result": OK, "batches": len(record.fed) + len(record.next)}


def _mismatch(message: str) -> dict[str, Any]:
    return {"result": MISMATCH, "message": message}


class ResumeAudit:
    """A loader's audit in mode ``"refuse"`` or ``"warn"`` (``"off"``: the loader has none)."""

    def __init__(self, loader: Any, mode: str):
        self.loader = weakref.proxy(loader)  # the loader holds its audit
        self.mode = mode
        depth = min(MAX_RING, AUDIT_BATCHES + loader.mode.batches_ahead + RING_SPARE)
        self.ring = FedRing(loader.mode.workers, depth, min(loader.batch_size, AUDIT_SLOTS))
        self.epoch: int | None = None  # the epoch of the current (or last) iteration
        self.start = self.count = 0  # the iteration's first batch in the epoch; batches handed out since
        self.segment = 0  # the batch the ring's current streams started at (an iteration, or a switch within it)
        self.rows: deque = deque(maxlen=depth)  # (step, rows) of gathered batches
        self._gathered: Any = None
        self.carried: tuple[AuditBatch, ...] = ()  # a loaded state's fed batches, before its position
        self.carried_at: tuple[int, int] | None = None  # (epoch, batches) of that state
        self.armed: tuple[int, int] | None = None  # a loaded state's (epoch, batches): check what follows it
        self.live: range = range(0)  # steps of this iteration still to check against the plan
        self.live_checked = 0  # of them, those the ring still held
        self.result: dict[str, Any] | None = None  # the last loaded state's audit
        self.on_event: Callable[[dict], Any] | None = None

    # -- iteration --------------------------------------------------------------------------------------------------
    def begin(self) -> None:
        """An iteration of the current epoch starts (before its run asks the cursor where)."""
        loader = self.loader
        self.epoch, self.start, self.count = loader.dataset.epoch, loader.cursor.upcoming(), 0
        self.segment = self.start
        self.ring.new_iteration()
        self.rows.clear()
        self._gathered = None
        if self.carried_at is not None and self.carried_at != (self.epoch, self.start):
            self.carried, self.carried_at = (), None
        armed, self.armed = self.armed, None
        self.live_checked = 0
        self.live = range(self.start, self.start + AUDIT_BATCHES) if armed == (self.epoch, self.start) else range(0)

    def switched(self, batches: int) -> None:
        """The loader's own position was reloaded within this iteration (``Auto``'s switch, the watchdog's
        restart): streams start afresh there, recording in a new generation of the ring."""
        self.segment = batches
        self.ring.new_iteration()

    def gathered(self, rows: Any) -> None:
        """The rows the batch about to be handed out was gathered from (a run that gathers whole batches)."""
        self._gathered = rows

    def handed(self) -> None:
        """One batch is handed out; the first ones after a resume are checked against the plan."""
        step = self.start + self.count
        self.count += 1
        if self._gathered is not None:
            self.rows.append((step, self._gathered))
            self._gathered = None
        if step in self.live:
            self._check_fed(step)

    def _check_fed(self, step: int) -> None:
        loader, epoch = self.loader, self.epoch
        last = step == self.live[-1]
        fed = self.fed_batch(step)
        found = None if fed is None else first_mismatch(fed, row_keys(loader.dataset, loader.batch_rows(epoch, step)))
        self.live_checked += fed is not None
        if found is None and not last:
            return
        self.live = range(0)
        checked = {"result": OK, "batches": self.live_checked} if self.live_checked else \
            {"result": NOT_AUDITED, "reason": "the batches fed after the resume were not recorded"}
        outcome = checked if found is None else _mismatch(
            mismatch_line(epoch, step, found[0], found[1], "the batch fed after the resume", fed.size))
        if self.on_event is not None:
            self.on_event({"kind": AUDIT_EVENT, "check": "fed after resume", **outcome})
        if found is None:
            return
        self.result = {**(self.result or {}), **outcome}
        if self.mode == "refuse":
            raise ResumeAuditError(outcome["message"])
        log.warning("%s", outcome["message"])

    # -- what was fed ----------------------------------------------------------------------------------------------
    def fed_batch(self, step: int) -> AuditBatch | None:
        """Batch ``step`` of the current epoch as it was fed (None: not recorded, or no longer held)."""
        loader = self.loader
        if self.epoch == loader.dataset.epoch and self.start <= step < self.start + self.count:
            for at, rows in self.rows:
                if at == step:
                    keys = row_keys(loader.dataset, np.asarray(rows))
                    return AuditBatch(step, len(keys), key_hashes(keys))
            return self._from_ring(step)
        if self.carried_at is not None and self.carried_at[0] == loader.dataset.epoch:
            return next((b for b in self.carried if b.step == step), None)
        return None

    def _from_ring(self, step: int) -> AuditBatch | None:
        cursor = self.loader.cursor
        samples = cursor.rank_samples()
        counts = worker_batches(samples, cursor.num_workers, cursor.batch_size, cursor.drop_last, cursor.split_batch)
        before = cursor.batches_before()
        if not self.segment <= step < before + sum(counts):
            return None
        taken, worker = round_robin_consumed(counts, step - before)
        started, _ = round_robin_consumed(counts, self.segment - before)  # each stream's batches before this one
        batch = taken[worker]
        held = worker_sample_counts(samples, max(1, cursor.num_workers), cursor.split_batch)[worker]
        size = min(cursor.batch_size, held - batch * cursor.batch_size)
        hashes = self.ring.read(worker, self.epoch, batch - started[worker], size)
        if hashes is None or (hashes < 0).any():  # overwritten, or a slot whose key was unreadable
            return None
        return AuditBatch(step, size, hashes)

    # -- saving and loading ----------------------------------------------------------------------------------------
    def record(self, state: dict[str, Any], batches_consumed: int | None) -> dict[str, Any]:
        """The audit record of ``state`` (the loader's position as saved)."""
        loader = self.loader
        position = LoaderState.from_dict(state)
        iterated = self.epoch == loader.dataset.epoch and (self.count or self.carried_at is None)
        through = batches_consumed if batches_consumed is not None else \
            (self.start + self.count if iterated else position.batches)
        fed = tuple(b for step in range(max(0, through - AUDIT_BATCHES), through)
                    if (b := self.fed_batch(step)) is not None)
        rank = loader.dataset.config.rank
        upcoming = []
        source = loader.dataset.epoch_source()
        for step in range(position.batches, min(position.batches + AUDIT_BATCHES, len(loader))):
            keys = plan_keys(loader.dataset, source, position, rank, step)
            upcoming.append(AuditBatch(step, len(keys), key_hashes(keys)))
        return AuditRecord(rank, through, fed, tuple(upcoming)).to_dict()

    def loaded(self, state: SavedState, continued: Any, verdict: dict[str, Any]) -> None:
        """``state`` was loaded (``verdict``: its audit): carry its fed batches, check what follows it."""
        record = state.audit
        at = (continued.position.epoch, continued.position.batches)
        self.carried, self.carried_at = (record.fed if record is not None else ()), at
        self.armed = at
        self.epoch, self.start, self.count = None, at[1], 0  # nothing handed out since the state
        self.result = verdict


def fed_batches(audit: ResumeAudit | None, batches: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    """An iteration's batches from ``batches()`` (the run's), each counted by ``audit`` as it is handed out: the
    loader's own count of what it fed, and the first batches after a resume checked against the plan. Without an
    audit, the batches as they come."""
    if audit is None:
        yield from batches()
        return
    audit.begin()  # before the run asks the cursor where
    for batch in batches():
        audit.handed()
        yield batch


def saved_with_audit(loader: Any, state: dict[str, Any], batches_consumed: int | None) -> dict[str, Any]:
    """``state`` with ``loader``'s audit record (unchanged without an audit)."""
    if loader.audit is not None:
        state[AUDIT] = loader.audit.record(state, batches_consumed)
    return state


def resume_verdict(loader: Any, state: SavedState) -> dict[str, Any]:
    """Audit ``state`` for ``loader.load_state_dict`` per the loader's mode: raise on a mismatch (``"refuse"``),
    log it (``"warn"``); ``{"result": "off"}`` without an audit."""
    if loader.audit is None:
        return {"result": OFF}
    verdict = check_state(loader, state)
    if verdict["result"] == MISMATCH:
        if loader.audit.mode == "refuse":
            raise ResumeAuditError(verdict["message"])
        log.warning("%s", verdict["message"])
    return verdict


def last_verdict(loader: Any) -> dict[str, Any]:
    """The audit of the last state ``loader`` loaded (``resume_verdict``'s, a copy); ``{}`` before any state was
    loaded, ``{"result": "off"}`` without an audit."""
    if loader.audit is None:
        return {"result": OFF}
    return dict(loader.audit.result or {})
