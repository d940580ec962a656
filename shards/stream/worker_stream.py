"""One logical worker's stream over a dataset: the loop between the order and the batches.

The dataset is a source (``shards.stream.dataset``: which rows exist, how to read a slice and decode a sample); the
loader's cursor (``shards.position.cursor``) says where a stream starts and what it leaves out. This module is what
runs between them, per epoch and worker: take the worker's rows and yield order (``shards.order.order``; with class
weights the rows are the weighted draws), leave out what a resumed run consumed (before any reading), read the rows
as covering reads, put them in yield order, then decode and transform, each sample with its own seed. What one
stream needs from its loader comes in one frozen value, ``StreamJob``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from shards.cache.cached_shards import PlannedShard
from shards.errors import CorruptDataError
from shards.order.order import WorkerOrder
from shards.order.plan import ShardSlice, shard_offsets
from shards.order.reads import CoveringReads
from shards.order.stages import Broken
from shards.procs.decode_mark import decode_mark
from shards.procs.stage_times import SharedStageTimes, StageTally
from shards.stream.decode_ahead import DecodeAhead
from shards.stream.error_tally import ErrorTally, reason_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class StreamJob:
    """What logical ``worker`` of ``num_workers`` streams in ``epoch``, and what its loader lends it.

    ``split_batch``: the loader's batch size (the unit of the worker split); ``skip``: samples a resumed run had
    consumed; ``left``: the rows an epoch continued in another layout has left (None: the whole epoch);
    ``stage_times``: the loader's block to add stage seconds to (None: not timed), in row ``slot`` (None: this
    process's, by its DataLoader worker id); ``quarantine``: the global rows the loader's cursor keeps out (a
    stand-in fills each one's slot); ``watch``: a ``WorkerSlot`` to publish each sample in before decoding it
    (``shards.procs.worker_status``); ``decode_threads``: threads that decode the samples ahead, in order, while
    the stream reads on (``shards.stream.decode_ahead``; 1: one by one in the reading thread), or a ``DecodeAhead``
    pool shared with other streams; ``fed``: the loader's ``FedRing``, where the stream records the key of each
    slot it fills as it reads it (``shards.position.audit``; None: nothing recorded)."""

    epoch: int
    worker: int = 0
    num_workers: int = 1
    split_batch: int = 1
    skip: int = 0
    left: np.ndarray | None = None
    stage_times: SharedStageTimes | None = None
    slot: int | None = None
    quarantine: frozenset[int] = frozenset()
    watch: Any = None
    decode_threads: int | DecodeAhead = 1
    fed: Any = None


@dataclass
class StreamState:
    """What one stream (a logical worker's epoch) keeps while it runs: the next epoch it plans for the node cache
    (``(epoch, worker, workers, split_batch)``; None: nothing to plan) and how far its reads were offered for
    read-ahead (``[reads, index]``). Per stream, so streams in threads of one process never share it."""

    next_epoch: tuple[int, int, int, int] | None = None
    ahead: list | None = None


def worker_stream(dataset: Any, job: StreamJob) -> Iterator[Any]:
    """What ``job``'s worker yields from ``dataset`` (a ``ShardDataset``): its samples, decoded, in order."""
    tally = StageTally(job.stage_times, job.split_batch, slot=job.slot) if job.stage_times is not None else None
    order = dataset.worker_order(job.epoch, job.worker, job.num_workers, split_batch=job.split_batch, left=job.left)
    # Per stream, never on the dataset: a loader's threads run several streams over one dataset object.
    stream = StreamState(next_epoch=(job.epoch + 1, job.worker, job.num_workers, job.split_batch))
    try:
        recorder = job.fed.writer(job.worker, job.epoch, job.split_batch) if job.fed is not None else None
        yield from _worker_samples(dataset, order, job, tally, stream, recorder)
    finally:
        if tally is not None:
            tally.flush()  # the samples since the last full batch, before the loader sees the stream end
        if dataset.shard_cache is not None:
            dataset.shard_cache.end_stream()


def _worker_samples(dataset: Any, order: WorkerOrder, job: StreamJob, tally: StageTally | None,
                    stream: StreamState, recorder: Any) -> Iterator[Any]:
    quarantine = job.quarantine
    policy = ErrorTally(dataset.config, dataset.shared_epoch, keeps_recent=bool(quarantine))
    seeds = dataset.sample_seeds(job.epoch, job.worker)
    if job.skip:  # read only the rows still to come
        order, seeds = order.after(job.skip), itertools.islice(seeds, job.skip, None)
    items: Iterator = planned_slices(dataset, order.rows, policy, stream)
    items = order.arrange(items)
    if tally is not None:
        items = tally.timed_read(items)
    jobs = ((where, sample, row, seed, isinstance(sample, Broken) or (bool(quarantine) and row in quarantine))
            for (where, sample, row), seed in zip(items, seeds))
    decode = functools.partial(_decode_job, dataset)
    if isinstance(job.decode_threads, DecodeAhead):  # a pool shared by several streams (the thread run mode's)
        results = job.decode_threads.results(jobs, decode, job.watch)
    elif job.decode_threads > 1:
        results = DecodeAhead(job.decode_threads).results(jobs, decode, job.watch, own=True)
    else:
        results = _decoded_here(dataset, jobs, job.watch)
    for where, sample, row, result in results:
        if recorder is not None:  # the slot's key as read, before a stand-in may fill it (as lineage names it)
            recorder.slot(sample.key)
        if isinstance(sample, Broken):
            yield from policy.skipped(where, sample.key, sample.reason)
            continue
        if result is None:  # quarantined
            yield from policy.stand_in()
            continue
        output, error, seconds = result
        if tally is not None and dataset.decode_timed:
            tally.decoded(*seconds)
        elif tally is not None:
            tally.sample_done()
        if error is not None:
            yield from policy.skipped(where, sample.key, reason_of(error, where))
            continue
        yield from policy.emit(_packed(dataset, output, sample))
    yield from policy.finish(dataset.config.split)


def _packed(dataset: Any, output: Any, sample: Any) -> tuple:
    if dataset.config.return_keys:
        return output, sample.label, sample.key
    return output, sample.label


def planned_slices(dataset: Any, rows: np.ndarray, policy: ErrorTally,
                   stream: StreamState | None = None) -> Iterator[tuple[str, Any, int]]:
    """The rows in order, scattered rows of one shard in one read (``reads.CoveringReads``); with a node cache,
    the stream's plan goes to the cache, which fetches shards ahead along it (``_cache_plan``)."""
    stream = stream if stream is not None else StreamState()
    reads = CoveringReads(rows, shard_offsets(dataset.shard_sizes), dataset.merge_gap)
    places = _cache_plan(dataset, reads, stream)
    for i, (piece, keep) in enumerate(reads):
        if places is not None and places[i] >= 0:
            dataset.shard_cache.reached(int(places[i]))
        dataset.read_ahead(reads, i, stream)
        yield from _guarded_slice(dataset, piece, policy, keep)


def _cache_plan(dataset: Any, reads: CoveringReads, stream: StreamState) -> np.ndarray | None:
    """Tell the node cache this stream's plan (``CachedShards.plan``, docs/caching.md): its cached shards in read
    order, one per run of reads of a shard, and the next epoch's (the same worker's order for epoch + 1, a pure
    function). Per read, its shard's place in the plan (-1: not cached); None without a cache."""
    cache = dataset.shard_cache
    if cache is None:
        return None
    locations, shards = dataset.locations, dataset.split_info.shards
    known: dict[int, PlannedShard | None] = {}  # shard number -> its plan entry, looked up once
    this_epoch, places = cache.planned_runs(
        np.fromiter((reads.shard(i) for i in range(len(reads))), dtype=np.int64, count=len(reads)),
        locations, shards, known)
    next_epoch: list[str] = []
    if stream.next_epoch is not None and cache.plans_ahead:
        epoch, worker, num_workers, split_batch = stream.next_epoch
        rows = dataset.worker_order(epoch, worker, num_workers, split_batch=split_batch).rows
        numbers = np.searchsorted(shard_offsets(dataset.shard_sizes), rows, side="right") - 1
        upcoming, _ = cache.planned_runs(numbers, locations, shards, known)
        next_epoch = [shard.sha256 for shard in upcoming]
    cache.plan(this_epoch, next_epoch)
    return places


def _decoded_here(dataset: Any, jobs: Iterator[tuple], watch: Any) -> Iterator[tuple]:
    """``(where, sample, row, result)`` per job, decoded in this thread; ``result`` None for a sample passed
    over (broken or quarantined)."""
    for where, sample, row, seed, passed in jobs:
        if passed:
            yield where, sample, row, None
            continue
        if watch is not None:
            watch.working(row, sample.key)
        yield where, sample, row, _decode_job(dataset, sample, seed, row)


def _decode_job(dataset: Any, sample: Any, seed: int, row: int) -> tuple[Any, CorruptDataError | None, tuple]:
    """``(output, error, (began, decoded_at, ended))`` of one ``decode_row`` call, in whichever thread runs it:
    the seconds split into decode and transform where the decoder marked the boundary in this thread
    (``shards.procs.decode_mark``; a user's decoder may set ``decoded_at`` on itself instead). The thread run mode
    finds a stuck sample by this function's name and its ``row`` (``shards.loader.threads``)."""
    began = time.perf_counter()
    output, error = None, None
    try:
        output = dataset.decode_row(sample, seed, row)
    except CorruptDataError as exc:
        error = exc
    ended = time.perf_counter()
    mark = decode_mark()
    if mark is None or not began <= mark <= ended:
        mark = getattr(dataset.decode_marker(), "decoded_at", None)
    return output, error, (began, mark, ended)


def _guarded_slice(dataset: Any, piece: ShardSlice, policy: ErrorTally,
                   keep: np.ndarray | None = None) -> Iterator[tuple[str, Any, int]]:
    """Read one slice as ``(where, sample, global row)``, only the positions ``keep`` names (None: all); check
    it really holds as many samples as the manifest says.

    A damaged sample the reader passed over (``read_resync``) is a ``Broken`` marker in its row; an error that
    ends the slice marks every row left (the first with the error's key)."""
    where = dataset.locations[piece.shard]
    first = dataset.first_row(piece.shard) + piece.start
    on_error = dataset.config.on_error
    wanted = None
    if keep is not None:
        wanted = np.bincount(keep, minlength=piece.size)  # a class-weighted draw may name a row twice
    count = 0
    try:
        for sample in dataset.read_resync(piece):
            if isinstance(sample, CorruptDataError):
                if on_error == "raise":
                    raise sample
                sample = Broken(sample.key, -1, reason_of(sample, where))
            for _ in range(1 if wanted is None else int(wanted[count])):
                yield where, sample, first + count
            count += 1
        if count < piece.size:
            raise CorruptDataError(f"shard ended after sample {piece.start + count}, the manifest says "
                                   f"{dataset.split_info.shards[piece.shard].samples}", path=where)
    except GeneratorExit:
        # The epoch was left early: this generator is closed, perhaps at interpreter exit, when the module's
        # globals below (``CorruptDataError``) may already be None, which ``except`` would refuse to match.
        raise
    except CorruptDataError as exc:
        if on_error == "raise":
            raise
        if count == piece.size:  # found after the last sample (a checksum): nothing left to skip
            log.warning("samples already used from a damaged shard: %s", exc)
        for offset in range(count, piece.size):
            for _ in range(1 if wanted is None else int(wanted[offset])):
                key = exc.key if offset == count else None
                yield where, Broken(key, -1, reason_of(exc, where)), first + offset
