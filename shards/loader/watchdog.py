"""Stall and crash recovery for a loader's DataLoader worker processes, with quarantine (``StallPolicy``).

A worker that hangs on one sample (a decoder in a loop, a read that never returns) hangs the whole job, and one the
OOM killer or a codec's segfault ends takes the run with it; DataLoader's own ``timeout`` only raises. The main
process already knows its exact position (the batches it handed out, ``shards.position.cursor``) and each worker
publishes the sample it is decoding (``shards.procs.worker_status``), so when no batch arrives for
``timeout_s`` or a worker process is gone, the watchdog:

1. writes the Python stacks of the workers still alive (``faulthandler`` on ``SIGUSR1``, registered when each
   worker starts) and, for a dead one, its exit code or signal and the sample it was on, into one dump file (the
   log gets it too) and reports a ``restart`` event;
2. kills every worker (``SIGKILL``: a stopped or hung one would not exit on request) and continues the epoch with
   fresh workers at the exact position, through the loader's own ``state_dict``/``load_state_dict``, so the epoch
   yields every sample once, in the order of a run without the fault;
3. quarantines the sample a worker hung or died on for the second time: its slot gets a stand-in, as
   ``on_error="skip"`` fills a broken sample's (``shards.stream.error_tally``), so batch and rank counts stay
   equal; the quarantine is the loader's cursor's (``Cursor.keep_out``, which reaches the workers), and its state
   carries it, so a resumed run keeps the sample out.

With ``on_error="raise"`` a stall is an error naming shard, key and the stuck frame instead of a restart; a dead
worker is restarted under either policy (the OOM killer is no verdict on the sample), and a sample that kills
workers twice is quarantined under either: that it ends every process that decodes it is the verdict.

The cap counts failures without progress, not events: a restart counts against ``max_restarts`` only when no batch
was delivered and no sample quarantined since the restart before it. A bad sample takes two restarts to quarantine,
so counting every restart would stop a healthy epoch that met two; counted so, an epoch meets any number of sparse
bad samples, while a node that fails on everything still stops loudly after a few restarts.

Each watched worker leads a process group, and a restart kills the group: whatever a hung decoder started dies with
it (what a worker answers by signal, and the kill, are ``shards.procs.worker_signals``). The stacks go to the dump
file; the log gets one warning naming it, and the stacks at INFO, so ``--quiet`` (warnings only) keeps them out of
stderr.

What it watches is torch's worker iterator, through two of its private hooks (``shards.procs.torch_private``, the
one module that names them): ``_get_data`` (replaced on the iterator by a loop of short ``_try_get_data`` polls
that watches the clock and the worker processes) and the worker pids torch's ``SIGCHLD`` handler would otherwise
turn into an exception raised wherever the main thread happens to be.
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from shards.atomic import write_text_shared
from shards.errors import CorruptDataError, InputError, ShardcacheError
from shards.procs import torch_private
from shards.order.plan import shard_offsets
from shards.procs.worker_signals import StackDumps, collect_stacks, exit_reason, stop_workers, stuck_frame
from shards.procs.worker_status import Busy, WorkerStatus

log = logging.getLogger(__name__)

QUARANTINE_AFTER = 2  # a worker hung or died on the same sample this many times: the sample is the cause
DEATH_WAIT_S = 1.0  # how long an error receiving a batch waits for the worker's exit to show


@dataclass(frozen=True)
class StallPolicy:
    """When to call a worker stalled and what to do about it: no batch for ``timeout_s`` seconds; at most
    ``max_restarts`` restarts without progress per epoch (see the module docstring); stack dumps into ``stack_dir``
    (None: a temporary folder; checked here, so a folder that cannot take them fails when the loader is made, not
    at the first stall); events (``{"kind": "restart" | "quarantine", ...}``, the data-events contract) to
    ``on_event``."""

    timeout_s: float
    max_restarts: int = 3
    stack_dir: str | None = None
    on_event: Callable[[dict], Any] | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise InputError(f"StallPolicy timeout_s must be a positive number of seconds, got {self.timeout_s}")
        if self.max_restarts < 0:
            raise InputError(f"StallPolicy max_restarts must be >= 0, got {self.max_restarts}")
        if self.stack_dir is not None:
            check_stack_dir(self.stack_dir)

    @property
    def poll_s(self) -> float:
        """How often the main process looks at the clock and the workers while it waits for a batch."""
        return min(0.1, self.timeout_s / 4)  # a wake-up only while the queue is empty: nothing while batches flow


def check_stack_dir(stack_dir: str) -> str:
    """``stack_dir`` if it is a folder this process can create files in; else an ``InputError`` naming it."""
    if not os.path.isdir(stack_dir):
        raise InputError(f"stack_dir {stack_dir!r} is not a folder: stack dumps of stalled workers go there")
    try:
        tempfile.TemporaryFile(dir=stack_dir).close()  # what a write needs, whatever the mode bits say (root)
    except OSError as exc:
        raise InputError(f"stack_dir {stack_dir!r} is not writable ({exc.strerror or exc}): stack dumps of stalled "
                         "workers go there") from None
    return stack_dir


class WorkerFault(Exception):
    """Raised inside the watched iterator: ``reason`` ``"stall"`` (``workers``: the one awaited) or ``"exit"``
    (``workers``: those gone)."""

    def __init__(self, reason: str, workers: list[int]):
        super().__init__(f"{reason}: workers {workers}")
        self.reason = reason
        self.workers = workers


class Watchdog:
    """The main process's side of recovery for one loader (see the module docstring): it quarantines through the
    loader's ``cursor``, the one owner of the quarantine."""

    def __init__(self, policy: StallPolicy, dataset: Any, cursor: Any):
        self.policy = policy
        self.dataset = dataset
        self.cursor = cursor
        self.status = WorkerStatus()
        self.folder = tempfile.mkdtemp(prefix="shardcache-stacks-")  # the workers' own dump files
        weakref.finalize(self, shutil.rmtree, self.folder, True)
        self.faults: Counter[int] = Counter()  # global row -> times a worker hung or died on it
        self.restarts: Counter[int] = Counter()  # epoch -> restarts
        self.fruitless: Counter[int] = Counter()  # epoch -> restarts without progress (the ones the cap counts)
        self._progress = (0, 0)  # (batches handed out, samples quarantined) at the last restart or iteration start
        self.dumps = 0
        self.stack_dir, self.on_event = policy.stack_dir, policy.on_event  # a trainer sets them once it has a run
        self._awaited: tuple[int, int] | None = None  # (iterator id, batch index) the clock runs for
        self._since = 0.0

    def worker_init(self, then: Callable[[int], Any] | None) -> StackDumps:
        return StackDumps(self.folder, then)

    # -- iteration -------------------------------------------------------------------------------------------------
    def batches(self, run: Any) -> Iterator[Any]:
        """A worker-process run's batches of its current epoch, healed: ``run.start_iteration()`` gives a DataLoader
        iterator at the cursor's position, ``run.restart()`` reloads the loader's own position on fresh workers."""
        iterator = self._start(run)
        self._progress = self._position()
        while True:
            # The yield stays outside the try: a generator dropped mid-epoch and closed at interpreter exit would
            # otherwise evaluate ``except WorkerFault`` after module teardown and print a TypeError.
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except WorkerFault as fault:
                self._recover(run, iterator, fault)
                iterator = self._start(run)
                continue
            self.cursor.handed += 1
            yield batch

    def _start(self, run: Any) -> Any:
        self.status.clear()
        iterator = run.start_iteration()
        self._adopt(iterator)
        return iterator

    def _position(self) -> tuple[int, int]:
        return self.cursor.handed, len(self.cursor.quarantine)

    def _adopt(self, iterator: Any) -> None:
        # Worker deaths are ours to handle: torch's SIGCHLD handler would raise wherever the main thread is.
        torch_private.release_sigchld(iterator)
        # A proxy: the iterator holding a strong reference to itself would outlive its last user until a cyclic
        # collection, workers and all. Of torch's iterator, not of a wrapper around it (``_Received``, one per
        # epoch): a persistent iterator calls its ``_get_data`` at the next epoch's start, the wrapper gone by then.
        target = getattr(iterator, "torch_iterator", iterator)
        torch_private.replace_get_data(target, functools.partial(self._get_data, weakref.proxy(target)))

    def _get_data(self, iterator: Any) -> Any:
        """What ``iterator._get_data`` does, in short polls: a worker gone or ``timeout_s`` without the awaited
        batch raises ``WorkerFault``. The clock starts when the main process starts waiting for a batch, so time
        the consumer spends between batches never counts."""
        awaited = (id(iterator), torch_private.awaited_index(iterator))
        if awaited != self._awaited:
            self._awaited, self._since = awaited, time.monotonic()
        while True:
            expected = torch_private.workers_expected(iterator)
            try:
                got, data = torch_private.try_get_data(iterator, self.policy.poll_s)
            except Exception:
                # A death shows as torch's RuntimeError, or as an error receiving a batch the worker sent just
                # before it died (its shared-memory handles went with it): give the exit a moment to show.
                dead = gone(iterator, expected, wait_s=DEATH_WAIT_S)
                if dead:
                    raise WorkerFault("exit", dead) from None
                raise
            if got:
                return data
            dead = gone(iterator, expected)
            if dead:
                raise WorkerFault("exit", dead)
            if torch_private.pin_thread_dead(iterator):
                raise RuntimeError("Pin memory thread exited unexpectedly")
            if time.monotonic() - self._since >= self.policy.timeout_s:
                raise WorkerFault("stall", torch_private.awaited_workers(iterator))

    # -- recovery --------------------------------------------------------------------------------------------------
    def _recover(self, run: Any, iterator: Any, fault: WorkerFault) -> None:
        workers = torch_private.worker_processes(iterator)
        epoch = self.dataset.epoch
        on = {w: self.status.busy(w) for w in fault.workers}
        stacks = collect_stacks(workers, self.folder)
        stop_workers(iterator)
        reasons = {w: "stall" if fault.reason == "stall" else exit_reason(workers[w].exitcode)
                   for w in fault.workers}
        self.dumps += 1
        report = self._report(workers, fault, on, reasons, stacks)
        dump = self._write_dump(report)
        log.warning("DataLoader worker(s) %s %s; stacks in %s", fault.workers,
                    "stalled" if fault.reason == "stall" else "died", dump)
        log.info("%s", report)  # INFO: --quiet keeps the stacks to the file
        reason = "; ".join(reasons.values()) or "stall"
        self._event({"kind": "restart", "workers": fault.workers, "reason": reason, "stacks": self._relative(dump)})
        if fault.reason == "stall" and self.dataset.config.on_error == "raise":
            self._raise_stall(fault, on, stacks, report_path=dump)
        for worker in fault.workers:
            if on[worker] is not None:
                self._blame(on[worker], reasons[worker])
        self.restarts[epoch] += 1
        before, self._progress = self._progress, self._position()
        if before == self._progress:  # no batch delivered and no sample quarantined since the last restart
            self.fruitless[epoch] += 1
        if self.fruitless[epoch] > self.policy.max_restarts:
            raise ShardcacheError(f"DataLoader workers restarted {self.fruitless[epoch]} times in epoch {epoch} "
                                  f"(max_restarts={self.policy.max_restarts}); last: {reason}; counted are restarts "
                                  f"with no batch delivered and no sample quarantined since the one before "
                                  f"({self.restarts[epoch]} in all); stacks in {dump}")
        run.restart()

    def _blame(self, busy: Busy, reason: str) -> None:
        """Count a fault against the sample a worker was on; quarantine it the second time."""
        self.faults[busy.row] += 1
        if self.faults[busy.row] < QUARANTINE_AFTER:
            return
        where = self.location_of(busy.row)
        self.cursor.keep_out({busy.row: busy.key})
        log.warning("quarantined sample %s [sample %s] (row %d): a worker hung or died on it %d times (%s)", where,
                    busy.key, busy.row, self.faults[busy.row], reason)
        self._event({"kind": "quarantine", "key": busy.key, "shard": where, "row": busy.row, "reason": reason})

    def _raise_stall(self, fault: WorkerFault, on: dict[int, Busy | None], stacks: dict[int, str],
                     report_path: str) -> None:
        worker = fault.workers[0] if fault.workers else None
        busy = on.get(worker)
        frame = stuck_frame(stacks.get(worker, "")) if worker is not None else None
        at = f", at {frame}" if frame else ""
        message = (f"DataLoader worker {worker} made no batch for {self.policy.timeout_s:g} s (stall_timeout)"
                   f"{' while decoding this sample' if busy else ''}{at}; stacks in {report_path}")
        if busy is None:
            raise CorruptDataError(message)
        raise CorruptDataError(message, path=self.location_of(busy.row), key=busy.key)

    def location_of(self, row: int) -> str:
        return row_location(self.dataset, row)

    # -- stacks and events -----------------------------------------------------------------------------------------
    def _report(self, workers: list, fault: WorkerFault, on: dict[int, Busy | None], reasons: dict[int, str],
                stacks: dict[int, str]) -> str:
        what = f"no batch for {self.policy.timeout_s:g} s" if fault.reason == "stall" else "worker(s) gone"
        lines = [f"# epoch {self.dataset.epoch}: {what}"]
        for index, process in enumerate(workers):
            busy = on.get(index) if index in on else self.status.busy(index)
            state = reasons.get(index) or ("stopped" if index not in stacks else "alive")
            sample = (f"on {self.location_of(busy.row)} [sample {busy.key}] (row {busy.row}) for "
                      f"{busy.seconds():.1f} s" if busy is not None else "not decoding")
            lines.append(f"## worker {index} (pid {process.pid}): {state}; {sample}")
            if index in stacks:
                lines.append(stacks[index].rstrip())
        return "\n".join(lines) + "\n"

    def _write_dump(self, report: str) -> str:
        """The report a message names: in ``stack_dir``, else the temp folder (as the thread mode's), never in
        ``self.folder``, which goes with the loader: the file a stall's error names must outlive the process."""
        folder = self.stack_dir or tempfile.gettempdir()
        name = f"worker-stacks-{os.getpid()}-{self.dumps}.txt" if self.stack_dir else \
            f"worker-stacks-{os.getpid()}-{time.time_ns()}-{self.dumps}.txt"
        path = os.path.join(folder, name)
        write_text_shared(path, report)
        return path

    def _relative(self, path: str) -> str:
        return os.path.relpath(path, self.stack_dir) if self.stack_dir else path

    def _event(self, event: dict) -> None:
        if self.on_event is not None:
            self.on_event(event)


def row_location(dataset: Any, row: int) -> str:
    """The shard of ``dataset`` that holds global ``row`` of the split."""
    firsts = shard_offsets(dataset.split_info.shard_sizes).tolist()
    return dataset.locations[bisect.bisect_right(firsts, row) - 1]


def gone(iterator: Any, expected: list[bool], wait_s: float = 0.0) -> list[int]:
    """Workers that ended while they still had work (torch marks one it finds dead as done, so ``expected`` is
    the status from before the poll), or with a non-zero exit code; waiting up to ``wait_s`` for one."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [index for index, process in enumerate(torch_private.worker_processes(iterator))
                if not process.is_alive() and (expected[index] or process.exitcode not in (0, None))]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.01)
