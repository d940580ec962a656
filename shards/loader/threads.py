"""Run mode ``Threads``: the epoch's logical workers as threads of the training process, no worker processes.

A DataLoader image costs far more than its decode: the worker pickles the batch into shared memory, the main process
maps and unpickles it, a pin thread copies it again. Decoders that release the GIL (simplejpeg, PIL, torch's uint8
kernels) run in parallel in threads as well as in processes, so a thread run keeps the parallel decode and drops the
hand-off: each thread fills its batch's tensor in place (``shards.loader.batch_fill``) and the training loop takes
it from a queue.

Each of the ``workers`` threads plays one logical worker of the epoch plan, exactly as a DataLoader worker does:
its stream is ``dataset.worker_stream(StreamJob(epoch, worker, workers, ...))`` with the same skips and rotation after a
resume, and the loader takes batches from the threads in the DataLoader's round robin (skipping those done). So
``Threads(n)`` and ``WorkerProcesses(n)`` feed the same batches in the same order, share one saved-state layout and
resume each other's states; order, lineage, quarantine, stage seconds and the node cache work as in processes.

Reading and decoding: a thread reads its stream (file reads and remote fetches release the GIL and overlap the
other threads' decoding); with ``decoders`` it hands the decoding to a pool of that many threads shared by all
workers (``shards.stream.decode_ahead``), so I/O and CPU concurrency are set apart, as SPDL does.

What a thread cannot do is die alone: a decoder that hangs holds its thread until the process ends, and one that
crashes the interpreter takes the training process with it. With a ``StallPolicy``, no batch for ``timeout_s``
ends the iteration with an error naming the sample each thread was on and the frame it is stuck in (all threads'
stacks go to a dump file); it cannot restart anything. Decoders that may hang or crash belong in
``WorkerProcesses(n)``, whose watchdog kills and restarts them (``shards.loader.watchdog``).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

from shards.atomic import write_text_shared
from shards.errors import CorruptDataError, InputError, ShardcacheError
from shards.loader.base import Loader, Run, RunMode
from shards.loader.batch_fill import BatchFill
from shards.procs.slabs import BufferPool
from shards.stream.transform_probe import global_draws
from shards.loader.budget import batch_bytes, dataset_read_ahead, fit_depth, split_budget
from shards.loader.watchdog import row_location
from shards.position.resume import STREAM
from shards.procs.stage_times import COLLATE
from shards.procs.values import MAX_WORKERS
from shards.procs.worker_status import WorkerStatus
from shards.stream.decode_ahead import AHEAD_PER_THREAD, DecodeAhead, intraop_threads, one_intraop_thread
from shards.stream.worker_stream import StreamJob

log = logging.getLogger(__name__)

# The iterations whose threads may still run, stopped at interpreter exit (``_stop_at_exit``): a script that leaves
# an iterator unfinished (``next(iter(loader))``) otherwise ends while daemon threads are inside torch, which aborts
# the process ("terminate called without an active exception", exit 134), and the generator's own cleanup runs
# during module teardown, when the names it needs are gone.
_LIVE: "weakref.WeakSet[_Epoch]" = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for epoch in list(_LIVE):
        epoch.stop()

THREAD_NAME = "shardcache-loader"


@dataclass(frozen=True)
class Threads(RunMode):
    """Run mode: ``workers`` threads of the training process, each one logical worker of the epoch plan (the same
    plan as ``WorkerProcesses(workers)``); ``decoders``: threads that decode for all of them (0: each worker
    thread decodes its own samples); ``prefetch``: batches each thread prepares ahead."""

    workers: int
    decoders: int = 0
    prefetch: int = 2

    kind = "threads"
    on_stall = "raise"  # ``ThreadRun`` watches its threads itself: ``supervise`` builds no watchdog
    RENAMED = {"prefetch_factor": "batches each worker prepares ahead are prefetch= in every run mode",
               "threads": "decode threads are decoders= in every run mode (0: each worker decodes its own samples)"}

    def __post_init__(self) -> None:
        if type(self.workers) is not int or not 1 <= self.workers <= MAX_WORKERS:
            raise InputError(f"Threads workers must be an integer in 1..{MAX_WORKERS}, got {self.workers!r}")
        if type(self.decoders) is not int or not 0 <= self.decoders <= 4 * MAX_WORKERS:
            raise InputError(f"Threads decoders must be an integer in 0..{4 * MAX_WORKERS}, got {self.decoders!r}")
        if type(self.prefetch) is not int or self.prefetch < 1:
            raise InputError(f"Threads prefetch must be an integer >= 1, got {self.prefetch!r}")

    @property
    def batches_ahead(self) -> int:
        return self.workers * (self.prefetch + 1)  # its queue, and the batch it fills while the queue is full

    def supervise(self, stall: Any, loader: Loader) -> None:
        return None  # a stall ends the run with an error naming the sample (``ThreadRun``): nothing restarts

    def layout(self, dataset: Any, batch_size: int) -> tuple[str, int]:
        return STREAM, batch_size

    def start(self, loader: Loader) -> Run:
        problem = self.unsuited(loader.dataset)
        if problem is not None:
            raise InputError(problem)
        return ThreadRun(loader, self)

    def unsuited(self, dataset: Any) -> str | None:
        """A callable transform that draws from a global random generator (torch's, Python's, NumPy's) on the
        dataset's first samples: it would race the training step's random numbers in threads, and threads cannot
        seed it per sample. One that draws nothing (a deterministic eval ``Compose``) runs here
        (``shards.stream.transform_probe``)."""
        return global_draws(dataset)


class _End:
    """A worker thread's stream ended."""


class _Failed:
    """A worker thread's stream raised ``error``."""

    def __init__(self, error: BaseException):
        self.error = error


class ThreadRun(Run):
    """The thread run of one loader: per iteration, one ``_Epoch`` of worker threads."""

    def __init__(self, loader: Loader, mode: Threads):
        # A proxy, not the loader: the loader holds its run (see DataLoaderRun).
        self.loader = weakref.proxy(loader)
        self.mode = mode
        self.status = WorkerStatus()  # what each thread decodes, for a stall's report
        self.depth: int | None = None  # each thread's queue, fitted to the loader's memory budget at the first epoch
        self.parts = None  # the budget divided (``shards.loader.budget.BudgetParts``), at the first epoch
        self._current: _Epoch | None = None
        self.buffers: BufferPool | None = None  # batch buffers reused between batches (``shards.procs.slabs``)

    def batches(self) -> Iterator[Any]:
        self.close()  # a new iteration: the last one's threads stop first
        if self.depth is None:
            loader, mode = self.loader, self.mode
            batch = batch_bytes(loader.dataset, loader.batch_size, mode.workers) if loader.memory is not None else 0
            reserved = 0
            if loader.memory is not None:  # the decoders' pool: each worker's stream decodes ahead within its part
                self.parts = split_budget(loader.memory, sample=batch // loader.batch_size, streams=mode.workers,
                                          ahead=AHEAD_PER_THREAD * mode.decoders,
                                          read_ahead=dataset_read_ahead(loader.dataset, 1),
                                          need=(2 * mode.workers + 1) * batch)
                reserved = self.parts.reserved
            # in flight: each thread's queue and the batch it fills, and the one the loop holds
            self.depth = fit_depth(loader.memory, batch, mode.workers, mode.prefetch, mode.workers + 1, mode,
                                   reserved)
            self.buffers = BufferPool(keep=mode.workers * (self.depth + 1) + 1)  # as many as are in flight
        epoch = self._current = _Epoch(self)
        cursor = self.loader.cursor
        try:
            for batch in epoch:
                cursor.handed += 1
                yield batch
        finally:
            epoch.stop()

    def close(self) -> None:
        if self._current is not None:
            self._current.stop()
            self._current = None


class _Epoch:
    """One iteration's worker threads and their queues, from the cursor's position."""

    def __init__(self, run: ThreadRun):
        loader, mode = run.loader, run.mode
        self.run, self.loader, self.workers = run, loader, mode.workers
        cursor, dataset = loader.cursor, loader.dataset
        continued = cursor.begin()
        resume = cursor.resume(continued)
        self.rotation = resume.rotation if resume is not None else 0
        left = continued.left if continued is not None and resume is not None and resume.remainder else None
        self.stopping = threading.Event()
        self.queues = [queue.Queue(maxsize=run.depth or mode.prefetch) for _ in range(self.workers)]
        ahead = run.parts.ahead if run.parts is not None and run.parts.ahead else None
        self.pool = DecodeAhead(mode.decoders, ahead) if mode.decoders else None
        run.status.clear()
        epoch, quarantine = dataset.epoch, cursor.shared_quarantine.rows()
        self.threads = [threading.Thread(
            target=self._work, name=f"{THREAD_NAME}-{w}", daemon=True,
            args=(w, epoch, resume.skips[w] if resume is not None else 0, left, quarantine)) for w in range(self.workers)]
        self.stopped = False
        self.keep = intraop_threads()  # the consumer's torch thread count, which the loader threads leave as it is
        _LIVE.add(self)
        for thread in self.threads:
            thread.start()

    # -- the worker threads ----------------------------------------------------------------------------------------
    def _work(self, worker: int, epoch: int, skip: int, left: Any, quarantine: frozenset[int]) -> None:
        loader = self.loader
        try:
            one_intraop_thread(self.keep)
            times = loader.stage_times
            fill = BatchFill(loader.batch_size, pin=loader.pin_memory and _cuda(), collate_fn=loader.collate_fn,
                             buffers=self.run.buffers)
            watch = self.run.status.slot(worker)
            stream = loader.dataset.worker_stream(StreamJob(
                epoch, worker, self.workers, split_batch=loader.batch_size, skip=skip, left=left, stage_times=times,
                slot=worker, quarantine=quarantine, watch=watch, decode_threads=self.pool or 1,
                fed=loader.audit.ring if loader.audit is not None else None))
            clock = time.perf_counter
            for sample in stream:
                watch.idle()
                if self.stopping.is_set():
                    return
                began = clock()
                fill.add(sample)
                batch = fill.take() if fill.count == loader.batch_size else None
                if times is not None:
                    times.add_one(worker, COLLATE, clock() - began)
                if batch is not None and not self._put(worker, batch):
                    return
            if fill.count and not loader.drop_last and not self._put(worker, fill.take()):
                return
            self._put(worker, _End())
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            self._put(worker, _Failed(exc))

    def _put(self, worker: int, item: Any) -> bool:
        """Queue ``item`` for the consumer; False when the iteration is stopping."""
        while not self.stopping.is_set():
            try:
                self.queues[worker].put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    # -- the consumer ----------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        live = [(self.rotation + p) % self.workers for p in range(self.workers)]  # the DataLoader's round robin
        while live:
            for worker in list(live):
                item = self._get(worker)
                if isinstance(item, _End):
                    live.remove(worker)
                    continue
                if isinstance(item, _Failed):
                    raise item.error
                yield item

    def _get(self, worker: int) -> Any:
        stall = self.loader.stall
        if stall is None:
            return self.queues[worker].get()
        since = time.monotonic()
        while True:
            try:
                return self.queues[worker].get(timeout=stall.poll_s)
            except queue.Empty:
                if time.monotonic() - since >= stall.timeout_s:
                    self._stalled(worker, stall)

    def _stalled(self, worker: int, stall: Any) -> None:
        """No batch from ``worker`` for ``timeout_s``: write every loader thread's stack, raise naming the sample."""
        busy = self.run.status.busy(worker)
        stacks = thread_stacks()
        dump = self._write_dump(stall, worker, busy, stacks)
        frame = stuck_frame(self.threads[worker], busy.row if busy is not None else None)
        at = f", at {frame}" if frame else ""
        what = "while decoding this sample" if busy is not None else "while reading (no sample being decoded)"
        message = (f"loader thread {worker} made no batch for {stall.timeout_s:g} s (stall_timeout) {what}{at}; a "
                   f"thread cannot be stopped or restarted: run decoders that may hang in WorkerProcesses(n), which "
                   f"restarts them; stacks in {dump}")
        self.stop(wait=False)
        if busy is None:
            raise ShardcacheError(message)
        raise CorruptDataError(message, path=self._location(busy.row), key=busy.key)

    def _location(self, row: int) -> str:
        return row_location(self.loader.dataset, row)

    def _write_dump(self, stall: Any, worker: int, busy: Any, stacks: dict[str, str]) -> str:
        lines = [f"# epoch {self.loader.dataset.epoch}: loader thread {worker} made no batch for {stall.timeout_s:g} s"]
        for w in range(self.workers):
            on = self.run.status.busy(w)
            sample = (f"on {self._location(on.row)} [sample {on.key}] (row {on.row}) for {on.seconds():.1f} s"
                      if on is not None else "not decoding")
            lines.append(f"## worker thread {w}: {sample}")
        for name, stack in stacks.items():
            lines += [f"## {name}", stack.rstrip()]
        folder = stall.stack_dir or tempfile.gettempdir()
        path = os.path.join(folder, f"loader-threads-{os.getpid()}-{time.time_ns()}.txt")
        write_text_shared(path, "\n".join(lines) + "\n")
        log.warning("loader thread %d stalled; stacks in %s", worker, path)
        return path

    def stop(self, wait: bool = True) -> None:
        """Stop the threads: each ends after its current sample (a hung one never does; it is left, a daemon).
        Once: a second call (the generator's cleanup after the exit handler) touches nothing."""
        if self.stopped:
            return
        self.stopped = True
        _LIVE.discard(self)
        self.stopping.set()
        for q in self.queues:  # a thread blocked on a full queue sees the stop at its next try
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        if wait:
            for thread in self.threads:
                if thread is not threading.current_thread():
                    thread.join(timeout=1.0)
        if self.pool is not None:
            self.pool.close()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def thread_stacks() -> dict[str, str]:
    """The Python stack of every loader and decode thread of this process, by thread name."""
    frames = sys._current_frames()
    stacks = {}
    for thread in threading.enumerate():
        if thread.name.startswith((THREAD_NAME, "shardcache-decode")) and thread.ident in frames:
            stacks[f"{thread.name} (thread {thread.ident})"] = "".join(traceback.format_stack(frames[thread.ident]))
    return stacks


def stuck_frame(worker: threading.Thread, row: int | None) -> str | None:
    """Where ``worker``'s sample is stuck: the innermost frame of the thread decoding row ``row`` (a decode thread
    of the pool when one decodes it, else the worker thread itself), as ``function (file:line)``."""
    frames = sys._current_frames()
    candidates = [frames.get(worker.ident)]
    if row is not None:  # a pool's thread running this row's decode job
        for thread in threading.enumerate():
            frame = frames.get(thread.ident)
            if thread.name.startswith("shardcache-decode") and frame is not None and _decoding(frame, row):
                candidates.insert(0, frame)
    frame = next((f for f in candidates if f is not None), None)
    if frame is None:
        return None
    inner = frame
    while frame is not None and _waiting_in_library(frame):  # an Event.wait, a queue: name who waits
        frame = frame.f_back
    if frame is None or frame is inner:
        return _where(inner)
    return f"{_where(frame)}, waiting in {_where(inner)}"


def _where(frame: Any) -> str:
    return f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"


def _waiting_in_library(frame: Any) -> bool:
    path = frame.f_code.co_filename
    return os.path.basename(path) in ("threading.py", "queue.py") or f"concurrent{os.sep}futures" in path


def _decoding(frame: Any, row: int) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "_decode_job" and frame.f_locals.get("row") == row:
            return True
        frame = frame.f_back
    return False
