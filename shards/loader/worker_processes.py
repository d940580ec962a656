"""Run mode ``WorkerProcesses``: a DataLoader over the dataset's per-sample stream, in worker processes, with exact
mid-epoch resume.

A DataLoader over an ``IterableDataset`` asks its workers for batches in a fixed round robin (skipping exhausted
ones) and returns them in that order, and every worker's sample count is known from the epoch plan. So the main
process, counting only the batches it handed out, knows exactly how far each worker got; the cursor records that
count and a resumed run tells each worker how many samples to skip and which worker goes first (the layout and the
arithmetic live in ``shards.position.resume``). A state saved with another world size, worker count or batch size
continues over the samples its epoch had left (``shards.position.elastic``).

The epoch plan splits each rank's share between workers in whole batches (``WorkerFeed`` hands the batch size to the
workers), so a rank has at most one partial batch and ``drop_last`` loses fewer than ``batch_size`` samples.

What the workers need from the loader reaches them in ``WorkerFeed``, never written into the dataset: the resume of
the current iteration, the cursor's quarantine and the loader's stage-seconds block (shared memory, so persistent
workers see them change), and the watchdog's status slots. The collate function is wrapped to add its seconds.
A loader with a ``StallPolicy`` runs its batches through the watchdog (``shards.loader.watchdog``).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import weakref
from dataclasses import InitVar, dataclass
from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from shards.errors import InputError
from shards.jobs.parallel import start_context
from shards.lock import pid_alive
from shards.loader.base import Loader, Run, RunMode, restarted_by_watchdog
from shards.procs import torch_private
from shards.loader.watchdog import StallPolicy, Watchdog
from shards.loader.budget import BudgetParts, batch_bytes, dataset_read_ahead, fit_depth, split_budget
from shards.procs.shm import EXTRA_BATCHES, Handoff, PipedCollate, announce, plan_handoff, received, shm_free
from shards.procs.slabs import SlabCollate, SlabRing
from shards.procs.stage_times import SharedStageTimes, TimedCollate
from shards.procs.worker_status import WorkerStatus
from shards.position.elastic import Continuation
from shards.procs.values import MAX_WORKERS
from shards.position.resume import STREAM
from shards.position.shared_blocks import SharedQuarantine, SharedResume
from shards.stream.decode_ahead import AHEAD_PER_THREAD, DecodeAhead
from shards.stream.worker_stream import StreamJob


SLOT_SLACK = 4096  # a ring slot's bytes beyond the measured batch: alignment, a sample a little larger


@dataclass(frozen=True)
class WorkerProcesses(RunMode):
    """Run mode: ``workers`` DataLoader worker processes decode samples beside the training loop (images, or
    features through a DataLoader). ``prefetch``: batches each worker prepares ahead (DataLoader's
    ``prefetch_factor``); ``persistent``: keep the workers from epoch to epoch; ``decoders``: threads decoding
    beside each worker's reader (0: the worker decodes its own samples; ``shards.stream.decode_ahead``; SPDL's
    multi-threading in multi-processing: for decoders that hold the GIL, and to keep decoding off the training
    process's cores), each worker still one logical worker of the plan, so the batches are those of
    ``decoders=0``. The one mode a ``StallPolicy`` can heal: its workers can be restarted (``supervise``)."""

    workers: int
    prefetch: int = 4
    persistent: bool = True
    decoders: int = 0
    # The spellings of round 3, refused with this one (``RENAMED``): the option names are one vocabulary.
    prefetch_factor: InitVar[int | None] = None
    threads: InitVar[int | None] = None

    kind = "processes"
    on_stall = "restart"
    RENAMED = {"prefetch_factor": "batches each worker prepares ahead are prefetch= in every run mode",
               "threads": "decode threads are decoders= in every run mode (0: each worker decodes its own samples)"}

    def __post_init__(self, prefetch_factor: int | None = None, threads: int | None = None) -> None:
        for name, given in (("prefetch_factor", prefetch_factor), ("threads", threads)):
            if given is not None:
                raise InputError(f"WorkerProcesses({name}={given!r}): {self.RENAMED[name]}")
        if type(self.workers) is not int or not 1 <= self.workers <= MAX_WORKERS:
            raise InputError(f"WorkerProcesses workers must be an integer in 1..{MAX_WORKERS}, got {self.workers!r} "
                             "(no worker processes: InProcess())")
        if type(self.prefetch) is not int or self.prefetch < 1:
            raise InputError(f"WorkerProcesses prefetch must be an integer >= 1, got {self.prefetch!r}")
        if type(self.persistent) is not bool:
            raise InputError(f"WorkerProcesses persistent must be True or False, got {self.persistent!r}")
        if type(self.decoders) is not int or not (self.decoders == 0 or 2 <= self.decoders <= 64):
            raise InputError(f"WorkerProcesses decoders must be 0 (each worker decodes its own samples) or an "
                             f"integer in 2..64 (one decode thread beside a worker's reader gains nothing), got "
                             f"{self.decoders!r}")

    @property
    def batches_ahead(self) -> int:
        return self.workers * self.prefetch

    @property
    def restarts_each_epoch(self) -> bool:
        return not self.persistent

    def supervise(self, stall: StallPolicy | None, loader: Loader) -> Watchdog | None:
        return restarted_by_watchdog(stall, loader)

    def layout(self, dataset: Any, batch_size: int) -> tuple[str, int]:
        return STREAM, batch_size

    def start(self, loader: Loader) -> Run:
        return DataLoaderRun(loader, self.workers, prefetch_factor=self.prefetch, persistent=self.persistent,
                             threads=max(1, self.decoders))


class OrphanGuard:
    """A DataLoader ``worker_init_fn`` that ends a worker soon after the process that made the loader is gone.

    torch's own watchdog compares the worker's parent with the parent it saw when the worker loop started, so a
    worker still starting up when its parent is killed (seen with ``kill -9`` right after the first batch: one
    worker of two had not reached its loop) takes its new parent, pid 1, for the old one and waits forever, holding
    whatever it mapped (the decoded-image cache's memory). This guard compares against the pid recorded before the
    fork (whether it is still alive, not whether it is the parent: under forkserver it never is), from a daemon
    thread, once a second; ``worker_init_fn`` given by the caller still runs. The same thread keeps a SIGTERM sent
    to the whole job from ending the worker before the main process has saved its place.
    """

    INTERVAL_S = 1.0

    def __init__(self, then: Callable[[int], Any] | None = None):
        self.owner = os.getpid()
        self.then = then

    def __call__(self, worker_id: int) -> None:
        # Before any thread of ours starts (they inherit the mask): SIGTERM waits for _watch, not torch's handler.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=self._watch, name="shardcache-orphan-guard", daemon=True).start()
        if self.then is not None:
            self.then(worker_id)

    def _watch(self) -> None:
        """End the worker when the loader's process is gone (nobody will read what it makes), or on a SIGTERM from
        that process (torch ending a worker that did not stop in time). A SIGTERM from anyone else is left to the
        loader's process: Slurm and Kubernetes signal every process of the job, and torch's worker handler killed
        the workers while the main process was saving its place, so the command ended in torch's "DataLoader worker
        ... is killed by signal: Terminated" (exit 1, not 75). The main process stops its workers itself."""
        while pid_alive(self.owner):  # not getppid(): a forkserver or spawn helper may be the worker's parent
            term = signal.sigtimedwait({signal.SIGTERM}, self.INTERVAL_S)
            if term is not None and term.si_pid == self.owner:
                os._exit(0)
        os._exit(1)


class WorkerFeed(IterableDataset):
    """What the DataLoader's workers iterate: the dataset, with what the loader hands its workers (see the module
    docstring), so the loader never writes its settings or state into the dataset it wraps."""

    def __init__(self, dataset: Any, split_batch: int, stage_times: SharedStageTimes | None,
                 quarantine: SharedQuarantine, status: WorkerStatus | None = None, decode_threads: int = 1,
                 fed: Any = None):
        super().__init__()
        self.dataset = dataset
        self.split_batch = split_batch
        self.stage_times = stage_times
        self.quarantine = quarantine  # the cursor's: rows a restart or a loaded state kept out reach workers here
        self.status = status  # where workers publish the sample they decode (a watched loader's)
        self.decode_threads = decode_threads  # threads decoding inside each worker (``WorkerProcesses.threads``)
        self.decode_ahead: int | None = None  # samples each worker's threads decode ahead (fitted to the budget)
        self.fed = fed  # the loader's ``FedRing``: each slot's key as read (``shards.position.audit``), or None
        self.resume = SharedResume()  # skips and rotation: reach persistent workers too
        self.left = None  # an epoch continued in another layout: its rows left (a new DataLoader carries them)

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        physical, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        epoch = self.dataset.epoch
        resume = self.resume.read(epoch, num_workers)
        worker = (physical + (resume.rotation if resume else 0)) % num_workers
        watch = self.status.slot(physical) if self.status is not None and info is not None else None
        pool = None
        if self.decode_threads > 1 and self.decode_ahead:  # decode-ahead within the budget: this worker's own pool
            pool = DecodeAhead(self.decode_threads, self.decode_ahead)
        stream = self.dataset.worker_stream(StreamJob(
            epoch, worker, num_workers, split_batch=self.split_batch, skip=resume.skips[worker] if resume else 0,
            left=self.left if resume is not None and resume.remainder else None, stage_times=self.stage_times,
            quarantine=self.quarantine.rows(), watch=watch, decode_threads=pool or self.decode_threads,
            fed=self.fed))
        try:
            for output in stream:
                if watch is not None:
                    watch.idle()  # decoded: a stall from here on is not this sample's
                yield output
        finally:
            if pool is not None:
                pool.close()


class DataLoaderRun(Run):
    """A DataLoader over the loader's ``WorkerFeed`` with ``workers`` processes (0: in the main process, the
    ``InProcess`` mode of an image dataset)."""

    def __init__(self, loader: Loader, workers: int, *, prefetch_factor: int | None = None,
                 persistent: bool = False, threads: int = 1):
        # A proxy, not the loader: the loader holds its run, and a cycle between them would leave a dropped
        # loader to the cyclic collector, which may finalise torch's queues before the workers hear to stop
        # (each then waits out torch's 5 s join); without the cycle, dropping the loader frees it at once.
        self.loader = weakref.proxy(loader)
        self.cursor = loader.cursor
        watchdog = loader.watchdog
        times = loader.stage_times
        self.feed = WorkerFeed(loader.dataset, loader.batch_size, times, loader.cursor.shared_quarantine,
                               status=watchdog.status if watchdog is not None else None, decode_threads=threads,
                               fed=loader.audit.ring if loader.audit is not None else None)
        self._collate_fn = loader.collate_fn if loader.collate_fn is not None else default_collate
        self._times = times
        self.workers, self.prefetch_factor, self.threads = workers, prefetch_factor, threads
        self.parts: BudgetParts | None = None  # the loader's budget divided, at the first iteration
        self.handoff: Handoff | None = None  # planned at the first iteration (shards.procs.shm)
        self.ring: SlabRing | None = None  # the workers' reused batch slots, when the hand-off has them
        options = dict(loader.dataloader_options)
        if workers > 0:
            if options.get("multiprocessing_context") is None:  # never the interpreter's default (3.14: forkserver)
                options["multiprocessing_context"] = start_context()
            init = options.get("worker_init_fn")
            if watchdog is not None:
                init = watchdog.worker_init(init)
            options["worker_init_fn"] = OrphanGuard(init)
        self._dataloader_options = dict(
            batch_size=loader.batch_size, num_workers=workers, drop_last=loader.drop_last,
            pin_memory=loader.pin_memory, persistent_workers=persistent and workers > 0,
            prefetch_factor=prefetch_factor if workers > 0 else None, **options)
        self.dataloader = self._new_dataloader()
        self._iterators: weakref.WeakSet = weakref.WeakSet()  # this run's DataLoader iterators still alive

    def _new_dataloader(self) -> DataLoader:
        options = dict(self._dataloader_options)
        collate_fn = self._collate_fn
        if self.handoff is not None:
            options["prefetch_factor"] = self.handoff.prefetch_factor
            if self.handoff.piped:
                collate_fn, options["pin_memory"] = PipedCollate(collate_fn), False  # ``received`` pins
            elif self.ring is not None:
                collate_fn = SlabCollate(collate_fn, self.ring)
        if self._times is not None:
            collate_fn = TimedCollate(collate_fn, self._times)
        return DataLoader(self.feed, collate_fn=collate_fn, **options)

    def _plan_handoff(self) -> None:
        """Fit the batches waiting to the loader's memory budget (``shards.loader.budget``) and to what
        ``/dev/shm`` has free (``shards.procs.shm``), once, before the first workers start."""
        loader = self.loader
        size = batch_bytes(loader.dataset, loader.batch_size, self.workers, isolated=True)
        reserved = 0
        if loader.memory is not None:
            self.parts = split_budget(loader.memory, sample=size // loader.batch_size, streams=self.workers,
                                      ahead=AHEAD_PER_THREAD * self.threads if self.threads > 1 else 0,
                                      read_ahead=dataset_read_ahead(loader.dataset, self.workers),
                                      need=(self.workers + EXTRA_BATCHES) * size)
            self.feed.decode_ahead, reserved = self.parts.ahead, self.parts.reserved
        depth = fit_depth(loader.memory, size, self.workers, self.prefetch_factor, EXTRA_BATCHES, loader.mode,
                          reserved)
        self.handoff = plan_handoff(shm_free(), size, self.workers, depth)
        announce(self.handoff)
        if self.handoff.slots:
            self.ring = SlabRing(self.workers, self.handoff.slots, size + SLOT_SLACK)
        self.dataloader = self._new_dataloader()

    def batches(self) -> Iterator[Any]:
        watchdog = self.loader.watchdog
        if watchdog is not None:
            yield from watchdog.batches(self)
            return
        for batch in self.start_iteration():
            self.cursor.handed += 1
            yield batch

    def start_iteration(self) -> Iterator[Any]:
        """The DataLoader's iterator over the current epoch, from the cursor's position."""
        if self.handoff is None and self.workers > 0:
            self._plan_handoff()
        continued = self.cursor.begin()
        self.feed.left = continued.left if continued is not None else None
        self.feed.resume.write(self.cursor.resume(continued))  # before the workers start their epoch
        if self.ring is not None and all(torch_private.workers_stopped(it) for it in self._iterators):
            self.ring.reclaim()  # no worker of an earlier iteration is left to fill a slot
        iterator = iter(self.dataloader)
        self._iterators.add(iterator)
        piped = self.handoff is not None and self.handoff.piped
        if piped or self.ring is not None:  # a ring's batches the pin thread pins itself
            return _Received(iterator, functools.partial(received, pin=piped and self.loader.pin_memory))
        return iterator

    def restart(self) -> None:
        """Continue the current epoch on fresh workers (the old ones are gone) at the batches handed out, with
        the quarantine as it now is: the loader's own state, saved and loaded."""
        state = self.loader.position_state()
        if self.ring is not None:  # a killed worker may have left a slot half filled: fresh workers, fresh slots
            self.ring = SlabRing(self.ring.workers, self.ring.slots, self.ring.slot_bytes)
        self.dataloader = self._new_dataloader()
        self.loader.continue_from(state)

    def loaded(self, continued: Continuation) -> None:
        if self.dataloader.persistent_workers and continued.left is not None:
            self.dataloader = self._new_dataloader()  # running workers hold a feed without the rows left

    def close(self) -> None:
        """Shut the worker processes down now. A loader that is part of a reference cycle (a trainer's run holds
        the loader, the loader's watchdog a callback into the run) is otherwise freed by the cyclic collector,
        which may finalise torch's index queues before the iterator that still has to send its workers their
        stop signal: each worker then waits out torch's 5 s join before it is killed (an H200 node's 2 x 16
        workers kept ``train-from-shards`` alive 160 s after its last epoch)."""
        for iterator in list(self._iterators):
            torch_private.shutdown_workers(iterator)
        self._iterators.clear()
        torch_private.forget_persistent_iterator(self.dataloader)  # the next epoch starts fresh workers


class _Received:
    """A DataLoader iterator whose batches came by pipe or in ring slots, as tensors again; the attributes the
    watchdog reads and sets (``_get_data``, the worker status) are the DataLoader iterator's own."""

    def __init__(self, iterator: Any, convert: Callable[[Any], Any]):
        self.__dict__["_iterator"], self.__dict__["_convert"] = iterator, convert

    @property
    def torch_iterator(self) -> Any:
        return self._iterator

    def __iter__(self) -> _Received:
        return self

    def __next__(self) -> Any:
        return self._convert(next(self._iterator))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iterator, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._iterator, name, value)
