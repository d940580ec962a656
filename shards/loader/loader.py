"""``make_loader``: a DataLoader with sensible defaults around a streaming dataset, plus exact mid-epoch resume.

A DataLoader over an ``IterableDataset`` asks its workers for batches in a fixed round robin (skipping exhausted
ones) and returns them in that order, and every worker's sample count is known from the epoch plan. So the main
process, counting only the batches it handed out, knows exactly how far each worker got; ``state_dict`` records
that count and a resumed run tells each worker how many samples to skip and which worker goes first (the layout
and the arithmetic live in ``shards.position.resume``). A state saved with another world size, worker count or batch
size continues over the samples its epoch had left (``shards.position.elastic``).

The epoch plan splits each rank's share between workers in whole batches (the loader's ``WorkerFeed`` hands its
batch size to the workers), so a rank has at most one partial batch and ``drop_last`` loses fewer than
``batch_size`` samples.

Stage timing (``shards.loader.stage_times``, on unless ``stage_times=False``): the workers add their read, decode
and transform seconds to the dataset's shared block, and the collate function is wrapped to add its own, so
``stage_seconds()`` tells the training loop which stage of the workers it is waiting for.

Stall and crash recovery (``stall_timeout``, off by default): a watchdog (``shards.loader.watchdog``) restarts hung
or dead workers at the exact position and quarantines a sample that hangs or kills a worker twice.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from shards.stream.dataset import ShardDataset
from shards.lock import pid_alive
from shards.jobs.parallel import MAX_DEFAULT_WORKERS, usable_cpus
from shards.loader.feature_batches import FeatureBatchLoader
from shards.stream.feature_stream import FeatureShardDataset
from shards.loader.base import Loader
from shards.position.resume import STREAM, SharedResume
from shards.loader.watchdog import StallPolicy, Watchdog, check_stack_dir
from shards.loader.worker_status import WorkerStatus


def default_num_workers() -> int:
    """One worker per CPU this process may use, leaving one for the training loop, capped at 8."""
    return max(1, min(MAX_DEFAULT_WORKERS, usable_cpus() - 1))


class OrphanGuard:
    """A DataLoader ``worker_init_fn`` that ends a worker soon after the process that made the loader is gone.

    torch's own watchdog compares the worker's parent with the parent it saw when the worker loop started, so a
    worker still starting up when its parent is killed (seen with ``kill -9`` right after the first batch: one
    worker of two had not reached its loop) takes its new parent, pid 1, for the old one and waits forever, holding
    whatever it mapped (the decoded-image cache's memory). This guard compares against the pid recorded before the
    fork (whether it is still alive, not whether it is the parent: under forkserver it never is), from a daemon
    thread, once a second; ``worker_init_fn`` given by the caller still runs.
    """

    INTERVAL_S = 1.0

    def __init__(self, then: Callable[[int], Any] | None = None):
        self.owner = os.getpid()
        self.then = then

    def __call__(self, worker_id: int) -> None:
        threading.Thread(target=self._watch, name="shardcache-orphan-guard", daemon=True).start()
        if self.then is not None:
            self.then(worker_id)

    def _watch(self) -> None:
        while pid_alive(self.owner):  # not getppid(): a forkserver or spawn helper may be the worker's parent
            time.sleep(self.INTERVAL_S)
        os._exit(1)  # the loader's process is gone: nobody will read what this worker makes


class WorkerFeed(IterableDataset):
    """What the DataLoader's workers iterate: the dataset, with the loader's settings and the resume of the current
    iteration, so the loader never writes its settings into the dataset it wraps."""

    def __init__(self, dataset: ShardDataset, split_batch: int, timed: bool, status: WorkerStatus | None = None):
        super().__init__()
        self.dataset = dataset
        self.split_batch = split_batch
        self.timed = timed
        self.status = status  # where workers publish the sample they decode (a watched loader's)
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
        stream = self.dataset.worker_stream(
            epoch, worker, num_workers, split_batch=self.split_batch, skip=resume.skips[worker] if resume else 0,
            left=self.left if resume is not None and resume.remainder else None, timed=self.timed, watch=watch)
        if watch is None:
            yield from stream
            return
        for output in stream:
            watch.idle()  # decoded: a stall from here on is not this sample's
            yield output


class ShardLoader(Loader):
    """A DataLoader over the dataset's workers, with exact resume (see the module docstring)."""

    def __init__(self, dataset: ShardDataset, batch_size: int, *, num_workers: int, drop_last: bool,
                 collate_fn: Callable | None, pin_memory: bool, persistent_workers: bool,
                 prefetch_factor: int | None, stage_times: bool = True, stall: StallPolicy | None = None,
                 **dataloader_options: Any):
        # Whole batches per worker (see the module docstring): the split unit is the batch size.
        super().__init__(dataset, batch_size, STREAM, num_workers=num_workers, drop_last=drop_last,
                         split_batch=batch_size)
        # Only worker processes can hang apart from the loop or die; in-process loading has none to restart.
        self.watchdog = Watchdog(stall, dataset) if stall is not None and num_workers > 0 else None
        self.feed = WorkerFeed(dataset, batch_size, stage_times,
                               status=self.watchdog.status if self.watchdog is not None else None)
        collate_fn = collate_fn if collate_fn is not None else default_collate
        if stage_times:
            collate_fn = dataset.timed_collate(collate_fn)
        if num_workers > 0:
            init = dataloader_options.get("worker_init_fn")
            if self.watchdog is not None:
                init = self.watchdog.worker_init(init)
            dataloader_options["worker_init_fn"] = OrphanGuard(init)
        self._dataloader_options = dict(
            batch_size=batch_size, num_workers=num_workers, drop_last=drop_last,
            collate_fn=collate_fn, pin_memory=pin_memory,
            persistent_workers=persistent_workers and num_workers > 0,
            prefetch_factor=prefetch_factor if num_workers > 0 else None, **dataloader_options)
        self.loader = self._new_dataloader()
        self._iterators: weakref.WeakSet = weakref.WeakSet()  # this loader's DataLoader iterators still alive

    def _new_dataloader(self) -> DataLoader:
        return DataLoader(self.feed, **self._dataloader_options)

    @property
    def quarantined(self) -> tuple[tuple[int, str], ...]:
        """Samples kept out as sorted ``(global row, key)`` pairs (``shards.loader.watchdog``)."""
        return self.dataset.quarantined

    def report_faults(self, stack_dir: str | None, on_event: Callable[[dict], Any] | None) -> None:
        """Where stall recovery writes stack dumps and sends its events, for a caller that knows only after making
        the loader (a trainer's run folder); nothing without ``stall_timeout``. The folder is checked now."""
        if self.watchdog is not None:
            self.watchdog.stack_dir = None if stack_dir is None else check_stack_dir(stack_dir)
            self.watchdog.on_event = on_event

    def __iter__(self) -> Iterator[Any]:
        if self.watchdog is not None:
            yield from self.watchdog.batches(self)
            return
        for batch in self.start_iteration():
            self.cursor.handed += 1
            yield batch

    def start_iteration(self) -> Iterator[Any]:
        """The DataLoader's iterator over the current epoch, from the cursor's position."""
        cursor = self.cursor
        continued = cursor.begin()
        self.feed.left = continued.left if continued is not None else None
        self.feed.resume.write(cursor.resume(continued))  # before the workers start their epoch
        iterator = iter(self.loader)
        self._iterators.add(iterator)
        return iterator

    def close(self) -> None:
        """Shut the worker processes down now. A loader that is part of a reference cycle (a trainer's run holds
        the loader, the loader's watchdog a callback into the run) is otherwise freed by the cyclic collector,
        which may finalise torch's index queues before the iterator that still has to send its workers their
        stop signal: each worker then waits out torch's 5 s join before it is killed (an H200 node's 2 x 16
        workers kept ``train-from-shards`` alive 160 s after its last epoch)."""
        for iterator in list(self._iterators):
            shutdown = getattr(iterator, "_shutdown_workers", None)  # a multi-process iterator's
            if shutdown is not None:
                shutdown()
        self._iterators.clear()
        self.loader._iterator = None  # a persistent iterator: the next epoch starts fresh workers

    def restart(self) -> None:
        """Continue the current epoch on fresh workers (the old ones are gone) at the batches handed out, with
        the quarantine as it now is: the loader's own state, saved and loaded."""
        state = self.state_dict()
        self.loader = self._new_dataloader()
        self.load_state_dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        quarantined = self.dataset.quarantine
        continued = self.cursor.load(state)
        if self.loader.persistent_workers and (continued.left is not None or self.dataset.quarantine != quarantined):
            self.loader = self._new_dataloader()  # running workers hold a feed without the rows left


def make_loader(dataset: ShardDataset, batch_size: int = 256, *, num_workers: int | None = None,
                drop_last: bool | None = None, collate_fn: Callable | None = None, pin_memory: bool | None = None,
                persistent_workers: bool = True, prefetch_factor: int = 4, stage_times: bool = True,
                stall_timeout: float | None = None, max_restarts: int = 3, stack_dir: str | None = None,
                on_event: Callable[[dict], Any] | None = None, **dataloader_options: Any) -> Loader:
    """Batches from a dataset of ``open_dataset``, with defaults that suit it.

    Workers default to the usable CPUs minus one (max 8), ``pin_memory`` to whether CUDA is present, ``drop_last``
    to ``dataset.config.shuffle`` (training). A feature dataset gets an in-process ``FeatureBatchLoader`` (no
    workers: they only slow features down) unless ``num_workers`` asks for workers. ``stage_times=False`` turns
    off the per-stage seconds (``stage_seconds()`` then stays at 0), for measuring what they cost.

    ``stall_timeout`` (seconds; None: off): no batch for that long, or a worker process gone, restarts the workers
    at the exact position (``shards.loader.watchdog``); a sample a worker hung or died on twice is quarantined
    (``loader.quarantined``, carried in ``state_dict``). More than ``max_restarts`` restarts in one epoch that
    followed no progress (no batch delivered, no sample quarantined since the restart before) is an error. Stack
    dumps go to ``stack_dir`` (default: a temporary folder; one that is not a writable folder is refused here),
    ``restart``/``quarantine`` events to ``on_event(dict)``. Loaders without worker processes have nothing to
    restart and ignore it.
    """
    if drop_last is None:
        drop_last = dataset.config.shuffle
    if isinstance(dataset, FeatureShardDataset) and not num_workers:
        return FeatureBatchLoader(dataset, batch_size, drop_last=drop_last, stage_times=stage_times)
    if num_workers is None:
        num_workers = default_num_workers()
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    # DataLoader draws its workers' base seed from this generator at every iter(); left to the global RNG it
    # would shift the training loop's random numbers by one draw per epoch (and differently after a resume).
    dataloader_options.setdefault("generator", torch.Generator().manual_seed(dataset.config.seed))
    stall = None if stall_timeout is None else StallPolicy(stall_timeout, max_restarts, stack_dir, on_event)
    return ShardLoader(dataset, batch_size, num_workers=num_workers, drop_last=drop_last, collate_fn=collate_fn,
                       pin_memory=pin_memory, persistent_workers=persistent_workers,
                       prefetch_factor=prefetch_factor, stage_times=stage_times, stall=stall, **dataloader_options)


def pad_collate(batch: Sequence[tuple]) -> dict[str, Any]:
    """Collate images of different sizes: pad to the largest height and width (bottom/right, zeros).

    Returns ``{"images": [B, C, H, W], "labels": [B], "sizes": [B, 2] (h, w), "mask": [B, H, W] bool}`` and
    ``"keys"`` when samples carry them. PIL images become uint8 tensors; tensors keep their dtype.
    """
    from torchvision.transforms.functional import pil_to_tensor

    images = [item[0] if isinstance(item[0], torch.Tensor) else pil_to_tensor(item[0]) for item in batch]
    height = max(image.shape[-2] for image in images)
    width = max(image.shape[-1] for image in images)
    out = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    mask = torch.zeros((len(images), height, width), dtype=torch.bool)
    for i, image in enumerate(images):
        out[i, :, : image.shape[-2], : image.shape[-1]] = image
        mask[i, : image.shape[-2], : image.shape[-1]] = True
    result = {
        "images": out,
        "labels": torch.as_tensor([item[1] for item in batch], dtype=torch.int64),
        "sizes": torch.as_tensor([tuple(image.shape[-2:]) for image in images], dtype=torch.int64),
        "mask": mask,
    }
    if len(batch[0]) > 2:
        result["keys"] = [item[2] for item in batch]
    return result
