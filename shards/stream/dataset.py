"""The streaming ``IterableDataset`` family: one order, one stage pipeline, a reader per kind of shard.

Per epoch and worker: take the worker's rows and yield order (``shards.order.order``; with class weights the rows
are the weighted draws), leave out what a resumed run consumed (before any reading), read the rows as covering
reads, put them in yield order, then decode and transform. The decode step is a pluggable ``decoder(sample, seed)``
callable taking a ``RawSample`` and the sample's augmentation seed, so other output formats (uint8 tensors, batched
decoders) replace one object, not the loop, and no random state is shared between the reader and the decoder.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from torch.utils.data import IterableDataset, get_worker_info

from shards.cache.cached_shards import CachedShards, PlannedShard
from shards.position.cursor import Cursor
from shards.stream.error_tally import ErrorTally, reason_of
from shards.position.resume import STREAM, SharedEpochState
from shards.errors import CorruptDataError, InputError
from shards.manifest import SplitInfo
from shards.stream.options import ErrorPolicy
from shards.order.order import EpochSource, Layout, WorkerOrder, worker_order
from shards.order.plan import (
    STREAM_TRANSFORM, ShardSlice, check_nodes, CoveringReads, epoch_sizes, indices_to_slices,
    rng_for, shard_offsets,
)
from shards.select.mixture import Mixture
from shards.order.stages import Broken
from shards.procs.decode_mark import decode_mark
from shards.procs.stage_times import SharedStageTimes, StageTally
from shards.stream.decode_ahead import DecodeAhead

log = logging.getLogger(__name__)


@dataclass
class StreamState:
    """What one stream (a logical worker's epoch) keeps while it runs: the next epoch it plans for the node cache
    (``(epoch, worker, workers, split_batch)``; None: nothing to plan) and how far its reads were offered for
    read-ahead (``[reads, index]``). Per stream, so streams in threads of one process never share it."""

    next_epoch: tuple[int, int, int, int] | None = None
    ahead: list | None = None


@dataclass(frozen=True)
class StreamConfig:
    """How one rank streams a split; validated here so a bad option fails before any worker starts."""

    split: str = "train"
    shuffle: bool = True
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    shuffle_buffer: int = 512
    class_weights: tuple[float, ...] | None = None
    on_error: str = "raise"
    max_consecutive_errors: int = 10
    return_keys: bool = False
    # Node affinity of the shard order (``plan.shard_order``): the job's node count, ranks numbered node by node.
    nodes: int = 1
    rotate_every: int = 0
    # The in-process feature loader's windowed permutation (``shards.order.order``; 0: one whole permutation).
    feature_window: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise InputError(f"rank must be in 0..world_size-1, got rank={self.rank}, world_size={self.world_size}")
        check_nodes(self.nodes, self.world_size, self.rotate_every)
        if self.seed < 0:
            raise InputError(f"seed must be non-negative, got {self.seed}")
        ErrorPolicy(self.on_error, self.max_consecutive_errors)  # one validation of the error options
        if self.shuffle_buffer < 0 or self.max_consecutive_errors < 1:
            raise InputError("shuffle_buffer must be >= 0, max_consecutive_errors >= 1")
        if self.feature_window < 0:
            raise InputError(f"feature_window must be >= 0, got {self.feature_window}")
        if self.class_weights is not None and (min(self.class_weights, default=0) < 0 or not any(self.class_weights)):
            raise InputError(f"class_weights must be non-negative and not all zero, got {self.class_weights}")


class ShardDataset(IterableDataset):
    """Base of the family: plan, stages, epoch state, resume. Subclasses read slices and decode samples.

    Run-time state belongs to whoever iterates: a loader (``shards.loader.base``) keeps its position, quarantine and
    stage seconds itself and hands the workers what they need (``worker_stream``); the dataset holds only the epoch
    every loader over it streams. Iterated on its own, the dataset is its own loader and keeps its own (``_cursor``,
    ``stage_seconds()``). ``decode_timed = False``: a subclass whose decode step is no real work (features) leaves
    decode and transform at 0.
    """

    time_stages = True
    decode_timed = True

    def __init__(self, split: SplitInfo, locations: Sequence[str], config: StreamConfig,
                 num_classes: int | None = None, shard_cache: CachedShards | None = None):
        super().__init__()
        self.split_info = split
        self.locations = list(locations)
        self.config = config
        # The node-local shard cache (``shards.cache.cached_shards``), or None: every read goes to the source.
        self.shard_cache = shard_cache
        if shard_cache is not None and split.shards:
            where = self.locations[0].rsplit("/", 1)[0] if self.locations else config.split
            shard_cache.check_limit(max(s.bytes for s in split.shards), where)
        self.sizes = epoch_sizes(split.samples, config.world_size, config.drop_last)
        self._first_rows = shard_offsets(split.shard_sizes).tolist()  # each shard's first global row: cache keys
        self.num_classes = num_classes if num_classes is not None else len(split.class_counts)
        # The class names, label = index, as torchvision's ImageFolder has them: ``open_dataset`` sets them from the
        # manifest (a mixture's combined list; empty for a regression table); None for a dataset made without one.
        self.classes: list[str] | None = None
        self._state = SharedEpochState()
        self._stage_times = SharedStageTimes()
        # Iterated on its own, the dataset is its own loader of one worker and batches of one sample.
        self._cursor = Cursor(self, STREAM, batch_size=1, num_workers=0, drop_last=False, split_batch=1)
        self.mixture: Mixture | None = None  # several sources or a subset (``use_mixture``): the epoch's rows
        self.excluded: np.ndarray | None = None  # global rows left out of every epoch (``exclude_rows``)
        self.label_maps: list[Any] | None = None  # per shard: source label -> combined label, or None
        # Each global row's label, which class weighting draws by (``shards.select.labels``; None: no weights).
        self.row_labels: np.ndarray | None = None
        # Each global row's key from the column index, for the resume audit (``shards.select.row_keys``; None: none).
        self.key_columns: Any = None
        if self.sizes.dropped:
            log.info("Sampling(balance='drop') leaves out the last %d sample(s) of %r every epoch", self.sizes.dropped,
                     config.split)

    def use_mixture(self, mixture: Mixture, label_maps: Sequence[Any] | None = None) -> None:
        """Stream ``mixture``'s epochs (``shards.select.mixture``) over this dataset's shards, the combined split of
        its sources; ``label_maps`` map each shard's labels onto the combined classes."""
        if self.config.nodes > 1:
            raise InputError("node affinity (Distributed.nodes) orders whole shards of one dataset; a mixture or "
                             "subset orders its own runs: leave Distributed.nodes unset")
        self.mixture = mixture
        self.label_maps = None if label_maps is None or all(m is None for m in label_maps) else list(label_maps)
        self.sizes = epoch_sizes(mixture.epoch_size, self.config.world_size, self.config.drop_last)

    # -- what the outside uses -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.sizes.per_rank

    @property
    def epoch(self) -> int:
        return self._state.epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch to stream next; reaches DataLoader workers, including persistent ones."""
        self._state.epoch = epoch

    @property
    def skipped(self) -> int:
        """Samples skipped as unreadable (``on_error="skip"``), summed over all workers and epochs."""
        return self._state.skipped

    @property
    def dropped(self) -> int:
        return self.sizes.dropped

    @property
    def class_to_idx(self) -> dict[str, int] | None:
        """Class name -> label, as torchvision's ``ImageFolder.class_to_idx`` (None where ``classes`` is)."""
        return None if self.classes is None else {name: i for i, name in enumerate(self.classes)}

    def stage_seconds(self) -> dict[str, float]:
        """Busy seconds per worker stage (``read``, ``decode``, ``transform``, ``collate``) of this dataset's own
        iteration (a plain DataLoader's workers included; ``make_loader``'s loaders count their own), since the last
        ``reset_stage_seconds``."""
        return self._stage_times.snapshot()

    def reset_stage_seconds(self) -> None:
        self._stage_times.reset()

    def state_dict(self) -> dict[str, Any]:
        """Progress of in-process iteration (no DataLoader workers); ``make_loader``'s loaders have their own."""
        return self._cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._cursor.load(state)

    def epoch_source(self) -> EpochSource:
        return EpochSource.of(self.config, self.split_info.shard_sizes, self.mixture, self.excluded, self.row_labels)

    def exclude_rows(self, rows: np.ndarray) -> None:
        """Leave these global rows out of every epoch (the rest keep their order), before the loader iterates:
        ``shards.select.selection.exclude_keys`` finds them from keys. A mixture leaves samples out where it
        selects them (``Subset(exclude_keys=)``), since its draw sizes each epoch."""
        if self.mixture is not None:
            raise InputError("a mixture or subset leaves samples out through Subset(exclude_keys=...)")
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        self.excluded = rows if len(rows) else None
        self.sizes = epoch_sizes(self.split_info.samples - len(rows), self.config.world_size, self.config.drop_last)

    # -- the stream ------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        times = self._stage_times if self.time_stages else None
        if info is not None:  # inside a plain DataLoader's worker: its share of the epoch, from the start
            yield from self.worker_stream(self.epoch, info.id, info.num_workers, stage_times=times)
            return
        cursor = self._cursor
        continued = cursor.begin()
        resume = cursor.resume(continued)
        skip = resume.skips[0] if resume is not None else 0
        left = continued.left if continued is not None else None
        for output in self.worker_stream(self.epoch, 0, 1, skip=skip, left=left, stage_times=times,
                                         quarantine=frozenset(cursor.quarantine)):
            cursor.handed += 1
            yield output

    def worker_order(self, epoch: int, worker: int, num_workers: int, *, split_batch: int = 1,
                     left: np.ndarray | None = None, whole: bool = False) -> WorkerOrder:
        """``worker``'s rows and yield order this epoch (``shards.order.order``); ``left``: the rows an epoch
        continued in another layout has left."""
        c = self.config
        layout = Layout(c.world_size, c.nodes, num_workers, split_batch, whole=whole)
        return worker_order(self.epoch_source(), layout, epoch, c.rank, worker, left)

    def worker_plan(self, epoch: int, worker: int, num_workers: int, *, split_batch: int = 1,
                    left: np.ndarray | None = None) -> list[ShardSlice]:
        """The slices ``worker`` reads this epoch, in order."""
        rows = self.worker_order(epoch, worker, num_workers, split_batch=split_batch, left=left).rows
        return indices_to_slices(rows, shard_offsets(self.split_info.shard_sizes))

    def sample_seeds(self, epoch: int, worker: int) -> Iterator[int]:
        """The augmentation seed of each sample a worker yields, in order: ``base(seed, epoch, rank, worker) +
        position`` (position counts this worker's stream, skipped samples included).

        So a sample's augmentation depends on (seed, epoch, rank, worker, position), not on its key: the same
        run (same seed, world size and number of workers) replays it exactly, including after a resume, but
        another number of workers or ranks, which deals samples out differently, augments them differently.
        """
        c = self.config
        base = int(rng_for(c.seed, STREAM_TRANSFORM, epoch, c.rank, worker).integers(0, 2**62))
        return itertools.count(base)

    def worker_stream(self, epoch: int, worker: int, num_workers: int, *, split_batch: int = 1, skip: int = 0,
                      left: np.ndarray | None = None, stage_times: SharedStageTimes | None = None,
                      quarantine: frozenset[int] = frozenset(), watch: Any = None, slot: int | None = None,
                      decode_threads: int | DecodeAhead = 1, fed: Any = None) -> Iterator[Any]:
        """What logical ``worker`` of ``num_workers`` yields in ``epoch``, after ``skip`` samples a resumed run had
        consumed; ``split_batch``: the loader's batch size (the unit of the worker split); ``stage_times``: the
        loader's block to add stage seconds to (None: not timed), in row ``slot`` (None: this process's, by its
        DataLoader worker id); ``quarantine``: the global rows the loader's cursor keeps out (a stand-in fills each
        one's slot); ``watch``: a ``WorkerSlot`` to publish each sample in before decoding it
        (``shards.procs.worker_status``); ``decode_threads``: threads that decode this stream's samples ahead, in
        order, while this thread reads on (``shards.stream.decode_ahead``; 1: decoded one by one here), or a
        ``DecodeAhead`` pool shared with other streams; ``fed``: the loader's ``FedRing``, where this stream records
        the key of each slot it fills as it reads it (``shards.position.audit``; None: nothing recorded)."""
        tally = StageTally(stage_times, split_batch, slot=slot) if stage_times is not None else None
        order = self.worker_order(epoch, worker, num_workers, split_batch=split_batch, left=left)
        # Per stream, never on the dataset: a loader's threads run several streams over one dataset object.
        stream = StreamState(next_epoch=(epoch + 1, worker, num_workers, split_batch))
        try:
            recorder = fed.writer(worker, epoch, split_batch) if fed is not None else None
            yield from self._worker_samples(order, epoch, worker, skip, tally, watch, quarantine, decode_threads,
                                            stream, recorder)
        finally:
            if tally is not None:
                tally.flush()  # the samples since the last full batch, before the loader sees the stream end
            if self.shard_cache is not None:
                self.shard_cache.end_stream()

    def _planned_slices(self, rows: np.ndarray, policy: ErrorTally,
                        stream: StreamState | None = None) -> Iterator[tuple[str, Any]]:
        """The rows in order, scattered rows of one shard in one read (``plan.CoveringReads``); with a node cache,
        the stream's plan goes to the cache, which fetches shards ahead along it (``_cache_plan``)."""
        stream = stream if stream is not None else StreamState()
        reads = CoveringReads(rows, shard_offsets(self.split_info.shard_sizes), self.merge_gap)
        places = self._cache_plan(reads, stream)
        for i, (piece, keep) in enumerate(reads):
            if places is not None and places[i] >= 0:
                self.shard_cache.reached(int(places[i]))
            self._read_ahead(reads, i, stream)
            yield from self._guarded_slice(piece, policy, keep)

    def merge_gap(self, shard: int) -> int | None:
        """How many unwanted rows one read of ``shard`` may pass over to reach the next wanted ones (None: any)."""
        return None

    def _read_ahead(self, reads: CoveringReads, i: int, stream: StreamState) -> None:
        """Start the bytes of covering read ``i`` and the next ones early, where the storage can (image shards)."""

    def _cache_plan(self, reads: CoveringReads, stream: StreamState) -> np.ndarray | None:
        """Tell the node cache this stream's plan (``CachedShards.plan``, docs/caching.md): its cached shards in read
        order, one per run of reads of a shard, and the next epoch's (the same worker's order for epoch + 1, a
        pure function). Per read, its shard's place in the plan (-1: not cached); None without a cache."""
        cache = self.shard_cache
        if cache is None:
            return None
        known: dict[int, PlannedShard | None] = {}  # shard number -> its plan entry, looked up once
        this_epoch, places = cache.planned_runs(
            np.fromiter((reads.shard(i) for i in range(len(reads))), dtype=np.int64, count=len(reads)),
            self.locations, self.split_info.shards, known)
        next_epoch: list[str] = []
        if stream.next_epoch is not None and cache.plans_ahead:
            epoch, worker, num_workers, split_batch = stream.next_epoch
            rows = self.worker_order(epoch, worker, num_workers, split_batch=split_batch).rows
            shards = np.searchsorted(shard_offsets(self.split_info.shard_sizes), rows, side="right") - 1
            upcoming, _ = cache.planned_runs(shards, self.locations, self.split_info.shards, known)
            next_epoch = [shard.sha256 for shard in upcoming]
        cache.plan(this_epoch, next_epoch)
        return places

    def _through_cache(self, shard: int) -> bool:
        """Whether reads of ``shard`` go through the node cache (then the cache fetches it whole, not the reader)."""
        location, info = self.locations[shard], self.split_info.shards[shard]
        return self.shard_cache is not None and bool(info.sha256) and self.shard_cache.cached(location)

    def _cached_copy(self, shard: int) -> Any:
        """A lease on the node-local copy of a shard, or None (no cache, not cached, or no room: read the source)."""
        if not self._through_cache(shard):
            return None
        info = self.split_info.shards[shard]
        return self.shard_cache.lease(self.locations[shard], info.sha256, info.bytes)

    def _worker_samples(self, order: WorkerOrder, epoch: int, worker: int, skip: int,
                        tally: StageTally | None = None, watch: Any = None,
                        quarantine: frozenset[int] = frozenset(), decode_threads: int | DecodeAhead = 1,
                        stream: StreamState | None = None, recorder: Any = None) -> Iterator[Any]:
        c = self.config
        policy = ErrorTally(c, self._state, keeps_recent=bool(quarantine))
        seeds = self.sample_seeds(epoch, worker)
        if skip:  # read only the rows still to come
            order, seeds = order.after(skip), itertools.islice(seeds, skip, None)
        items: Iterator = self._planned_slices(order.rows, policy, stream)
        items = order.arrange(items)
        if tally is not None:
            items = tally.timed_read(items)
        jobs = ((where, sample, row, seed, isinstance(sample, Broken) or (bool(quarantine) and row in quarantine))
                for (where, sample, row), seed in zip(items, seeds))
        if isinstance(decode_threads, DecodeAhead):  # a pool shared by several streams (the thread run mode's)
            results = decode_threads.results(jobs, self._decode_job, watch)
        elif decode_threads > 1:
            results = DecodeAhead(decode_threads).results(jobs, self._decode_job, watch, own=True)
        else:
            results = self._decoded_here(jobs, watch)
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
            if tally is not None and self.decode_timed:
                tally.decoded(*seconds)
            elif tally is not None:
                tally.sample_done()
            if error is not None:
                yield from policy.skipped(where, sample.key, reason_of(error, where))
                continue
            yield from policy.emit(self._pack(output, sample))
        yield from policy.finish(self.config.split)

    def _decoded_here(self, jobs: Iterator[tuple], watch: Any) -> Iterator[tuple]:
        """``(where, sample, row, result)`` per job, decoded in this thread; ``result`` None for a sample passed
        over (broken or quarantined)."""
        for where, sample, row, seed, passed in jobs:
            if passed:
                yield where, sample, row, None
                continue
            if watch is not None:
                watch.working(row, sample.key)
            yield where, sample, row, self._decode_job(sample, seed, row)

    def _decode_job(self, sample: Any, seed: int, row: int) -> tuple[Any, CorruptDataError | None, tuple]:
        """``(output, error, (began, decoded_at, ended))`` of one ``decode_row`` call, in whichever thread runs it:
        the seconds split into decode and transform where the decoder marked the boundary in this thread
        (``shards.procs.decode_mark``; a user's decoder may set ``decoded_at`` on itself instead)."""
        began = time.perf_counter()
        output, error = None, None
        try:
            output = self.decode_row(sample, seed, row)
        except CorruptDataError as exc:
            error = exc
        ended = time.perf_counter()
        mark = decode_mark()
        if mark is None or not began <= mark <= ended:
            mark = getattr(self.decode_marker(), "decoded_at", None)
        return output, error, (began, mark, ended)

    def decode_marker(self) -> Any:
        """A user's decoder that marks where decoding ended by setting ``decoded_at`` on itself (a
        ``time.perf_counter()`` value), or None: without a mark the whole call counts as decode."""
        return None

    def normalizer(self, **options: Any) -> Callable:
        """The per-batch step from what this dataset yields to the model's input (a module: ``.to(device)``
        works). Here the identity: samples come ready (feature rows; images a standard transform normalised in
        the workers); a pipeline that leaves work for the consuming device overrides it. ``options``
        (``dtype``, ``channels_last``) shape a normaliser that has work to do; the identity passes batches on."""
        import torch  # loaded with the IterableDataset already; the name is only needed here

        return torch.nn.Identity()

    def _pack(self, output: Any, sample: Any) -> tuple:
        if self.config.return_keys:
            return output, sample.label, sample.key
        return output, sample.label

    def _guarded_slice(self, piece: ShardSlice, policy: ErrorTally,
                       keep: np.ndarray | None = None) -> Iterator[tuple[str, Any, int]]:
        """Read one slice as ``(where, sample, global row)``, only the positions ``keep`` names (None: all); check
        it really holds as many samples as the manifest says.

        A damaged sample the reader passed over (``read_resync``) is a ``Broken`` marker in its row; an error that
        ends the slice marks every row left (the first with the error's key)."""
        where = self.locations[piece.shard]
        first = self._first_rows[piece.shard] + piece.start
        wanted = None
        if keep is not None:
            wanted = np.bincount(keep, minlength=piece.size)  # a class-weighted draw may name a row twice
        count = 0
        try:
            for sample in self.read_resync(piece):
                if isinstance(sample, CorruptDataError):
                    if self.config.on_error == "raise":
                        raise sample
                    sample = Broken(sample.key, -1, reason_of(sample, where))
                for _ in range(1 if wanted is None else int(wanted[count])):
                    yield where, sample, first + count
                count += 1
            if count < piece.size:
                raise CorruptDataError(f"shard ended after sample {piece.start + count}, the manifest says "
                                       f"{self.split_info.shards[piece.shard].samples}", path=where)
        except GeneratorExit:
            # The epoch was left early: this generator is closed, perhaps at interpreter exit, when the module's
            # globals below (``CorruptDataError``) may already be None, which ``except`` would refuse to match.
            raise
        except CorruptDataError as exc:
            if self.config.on_error == "raise":
                raise
            if count == piece.size:  # found after the last sample (a checksum): nothing left to skip
                log.warning("samples already used from a damaged shard: %s", exc)
            for offset in range(count, piece.size):
                for _ in range(1 if wanted is None else int(wanted[offset])):
                    key = exc.key if offset == count else None
                    yield where, Broken(key, -1, reason_of(exc, where)), first + offset

    # -- what subclasses provide -----------------------------------------------------------------------------
    def read_slice(self, piece: ShardSlice) -> Iterator[Any]:
        """The slice's samples, in order; the first damaged one raises its ``CorruptDataError``."""
        raise NotImplementedError

    def read_resync(self, piece: ShardSlice) -> Iterator[Any]:
        """What the stream reads: ``read_slice``, but each damaged sample is its ``CorruptDataError`` in its place
        and reading goes on with the next, so one bad sample costs that sample only. By default the first error
        ends the slice (a feature shard is checked whole when it is loaded)."""
        return self.read_slice(piece)

    def decode(self, sample: Any, seed: int) -> Any:
        """``sample`` -> output; ``seed`` is the sample's augmentation seed (``sample_seeds``), the only source of
        randomness a decoder should use."""
        raise NotImplementedError

    def decode_row(self, sample: Any, seed: int, row: int) -> Any:
        """``decode`` for the sample at global ``row`` of the split, the key a cache of decoded samples uses."""
        return self.decode(sample, seed)

