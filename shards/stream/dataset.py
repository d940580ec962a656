"""The streaming ``IterableDataset`` family: one epoch plan, one stage pipeline, a reader per kind of shard.

Per epoch and worker: plan the slices (``shards.stream.plan``), read them sequentially, resample by class weight
(optional), shuffle through a seeded buffer, skip what a resumed run already consumed (before any decoding),
then decode and transform. The decode step is a pluggable ``decoder(sample, seed)`` callable taking a
``RawSample`` and the sample's augmentation seed, so other output formats (uint8 tensors, batched decoders)
replace one object, not the loop, and no random state is shared between the reader and the decoder.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from torch.utils.data import IterableDataset, get_worker_info

from shards.cache.cached_shards import CachedShards
from shards.stream.error_tally import ErrorTally, reason_of
from shards.stream.elastic import Continuation, EpochSource, continuation, dataset_fingerprint, sampling_settings
from shards.stream.resume import STREAM, LoaderState, Resume, SharedEpochState, stream_resume
from shards.errors import CorruptDataError, InputError
from shards.manifest import SplitInfo
from shards.stream.options import ErrorPolicy
from shards.stream.plan import (
    STREAM_CLASS_WEIGHTS, STREAM_SHUFFLE_BUFFER, STREAM_TRANSFORM, ShardSlice, check_nodes, covering_reads,
    epoch_sizes, indices_to_slices, plan_epoch, rng_for, shard_offsets, share_of, worker_range,
)
from shards.stream.mixture import Mixture
from shards.stream.stages import Broken, shuffle_buffer, weighted_windows
from shards.stream.stage_times import SharedStageTimes, StageTally, TimedCollate

log = logging.getLogger(__name__)


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
    weight_window: int = 1024
    on_error: str = "raise"
    max_consecutive_errors: int = 10
    return_keys: bool = False
    # Node affinity of the shard order (``plan.shard_order``): the job's node count, ranks numbered node by node.
    nodes: int = 1
    rotate_every: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise InputError(f"rank must be in 0..world_size-1, got rank={self.rank}, world_size={self.world_size}")
        check_nodes(self.nodes, self.world_size, self.rotate_every)
        if self.seed < 0:
            raise InputError(f"seed must be non-negative, got {self.seed}")
        ErrorPolicy(self.on_error, self.max_consecutive_errors)  # one validation of the error options
        if self.shuffle_buffer < 0 or self.weight_window < 1 or self.max_consecutive_errors < 1:
            raise InputError("shuffle_buffer must be >= 0, weight_window and max_consecutive_errors >= 1")
        if self.class_weights is not None and (min(self.class_weights, default=0) < 0 or not any(self.class_weights)):
            raise InputError(f"class_weights must be non-negative and not all zero, got {self.class_weights}")


class ShardDataset(IterableDataset):
    """Base of the family: plan, stages, epoch state, resume. Subclasses read slices and decode samples.

    ``time_stages`` (on by default; ``make_loader(stage_times=False)`` turns it off): every worker adds the seconds
    it spends reading, decoding and transforming to a shared block (``shards.stream.stage_times``), read back with
    ``stage_seconds()``. ``decode_timed = False``: a subclass whose decode step is no real work (features) leaves
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
        self._state = SharedEpochState()
        self._stage_times = SharedStageTimes()
        self._pending_resume: Resume | None = None
        self._yielded = 0
        # The unit of the split between DataLoader workers: ``make_loader`` sets its batch size, so every worker
        # but one yields whole batches; iterated without a loader, 1 (plain split).
        self.plan_batch_size = 1
        self._continued: Continuation | None = None  # the last loaded state: a remainder when the layout changed
        self._remainder_live = False  # whether the current iteration reads that remainder
        self.mixture: Mixture | None = None  # several sources or a subset (``use_mixture``): the epoch's rows
        self.label_maps: list[Any] | None = None  # per shard: source label -> combined label, or None
        if self.sizes.dropped:
            log.info("Sampling(balance='drop') leaves out the last %d sample(s) of %r every epoch", self.sizes.dropped,
                     config.split)

    def use_mixture(self, mixture: Mixture, label_maps: Sequence[Any] | None = None) -> None:
        """Stream ``mixture``'s epochs (``shards.stream.mixture``) over this dataset's shards, the combined split of
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

    def stage_seconds(self) -> dict[str, float]:
        """Busy seconds per worker stage (``read``, ``decode``, ``transform``, ``collate``), summed over all
        workers and epochs since the last ``reset_stage_seconds``."""
        return self._stage_times.snapshot()

    def reset_stage_seconds(self) -> None:
        self._stage_times.reset()

    def timed_collate(self, collate_fn: Callable) -> TimedCollate:
        """``collate_fn`` adding its seconds to this dataset's collate stage, from whichever worker runs it."""
        return TimedCollate(collate_fn, self._stage_times)

    def state_dict(self) -> dict[str, Any]:
        """Progress of in-process iteration (no DataLoader workers); ``make_loader``'s wrapper has its own."""
        remainder = self.active_remainder()
        prior = remainder.position.prior if remainder is not None else None
        return self._position((prior["batches"] if prior else 0) + self._yielded, prior).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.continue_from(state, self._position(0))

    def _position(self, samples: int, prior: dict[str, Any] | None = None) -> LoaderState:
        """In-process iteration as a loader of one worker and batches of one sample."""
        return self.loader_state(STREAM, samples, batch_size=1, num_workers=0, drop_last=False, split_batch=1,
                                 prior=prior)

    def loader_state(self, kind: str, batches: int, *, batch_size: int, num_workers: int, drop_last: bool,
                     split_batch: int, prior: dict[str, Any] | None = None) -> LoaderState:
        """A loader's position over this dataset, with the settings a resumed run is checked against."""
        c = self.config
        return LoaderState(kind, self.epoch, batches, batch_size=batch_size, num_workers=num_workers,
                           drop_last=drop_last, seed=c.seed, world_size=c.world_size, split_batch=split_batch,
                           dataset=self.mixture.fingerprint if self.mixture is not None
                           else dataset_fingerprint(self.split_info.shard_sizes),
                           sampling=sampling_settings(c), prior=prior, nodes=c.nodes)

    def epoch_source(self) -> EpochSource:
        return EpochSource.of(self.config, self.split_info.shard_sizes, self.mixture)

    def continue_from(self, state: dict[str, Any], current: LoaderState) -> LoaderState:
        """Make the next iteration continue the saved ``state`` in the layout ``current`` describes: bitwise exactly
        in the same layout, over the samples the epoch had left in another (``shards.stream.elastic``)."""
        continued = continuation(state, current, self.epoch_source(), self.config.rank)
        remainder = continued.rank_indices is not None
        self.set_epoch(continued.position.epoch)
        self._continued = continued
        per_rank = len(continued.rank_indices) if remainder else len(self)
        self.resume(stream_resume(continued.position, per_rank, remainder=remainder))
        return continued.position

    def active_remainder(self) -> Continuation | None:
        """The continuation whose remainder the current (or next) iteration of this epoch reads, if any."""
        live = self._pending_resume.remainder if self._pending_resume is not None else self._remainder_live
        continued = self._continued
        if live and continued is not None and continued.rank_indices is not None \
                and continued.position.epoch == self.epoch:
            return continued
        return None

    def resume(self, resume: Resume | None) -> None:
        """Make the next iteration continue an interrupted epoch (called by the ``load_state_dict`` methods)."""
        self._pending_resume = resume

    def publish_resume(self) -> None:
        """Hand the pending resume (or none) to the iteration about to start, then forget it.

        Called in the main process once per iteration: by ``__iter__`` itself when it runs there, and by the
        loader before DataLoader workers start (their ``__iter__`` only reads what was published).
        """
        self._state.write_resume(self._pending_resume)
        self._remainder_live = self._pending_resume is not None and self._pending_resume.remainder
        self._pending_resume = None

    # -- the stream ------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        in_main = info is None
        if in_main:
            self.publish_resume()
        physical, num_workers = (0, 1) if in_main else (info.id, info.num_workers)
        epoch = self._state.epoch
        resume = self._state.read_resume(epoch, num_workers)
        self._remainder_live = resume is not None and resume.remainder
        rotation = resume.rotation if resume else 0
        worker = (physical + rotation) % num_workers
        skip = resume.skips[worker] if resume else 0
        if in_main:
            self._yielded = skip
        for output in self._worker_stream(epoch, worker, num_workers, skip):
            if in_main:
                self._yielded += 1
            yield output

    def worker_plan(self, epoch: int, worker: int, num_workers: int) -> list[ShardSlice]:
        c = self.config
        remainder = self.active_remainder()
        if remainder is not None and remainder.position.epoch == epoch:
            rows = remainder.rank_indices
            start, stop = worker_range(len(rows), worker, num_workers, self.plan_batch_size)
            return indices_to_slices(rows[start:stop], shard_offsets(self.split_info.shard_sizes))
        if self.mixture is not None:
            rows = share_of(self.mixture.stream(epoch), rank=c.rank, world_size=c.world_size, worker=worker,
                            num_workers=num_workers, drop_last=c.drop_last, batch_size=self.plan_batch_size)
            return indices_to_slices(rows, shard_offsets(self.split_info.shard_sizes))
        return plan_epoch(self.split_info.shard_sizes, seed=c.seed, epoch=epoch, rank=c.rank,
                          world_size=c.world_size, worker=worker, num_workers=num_workers,
                          drop_last=c.drop_last, shuffle=c.shuffle, batch_size=self.plan_batch_size,
                          nodes=c.nodes, rotate_every=c.rotate_every)

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

    def _worker_stream(self, epoch: int, worker: int, num_workers: int, skip: int) -> Iterator[Any]:
        tally = StageTally(self._stage_times, self.plan_batch_size) if self.time_stages else None
        try:
            yield from self._worker_samples(epoch, worker, num_workers, skip, tally)
        finally:
            if tally is not None:
                tally.flush()  # the samples since the last full batch, before the loader sees the stream end
            if self.shard_cache is not None:
                self.shard_cache.drop_prefetched()

    def _planned_slices(self, plan: list[ShardSlice], policy: ErrorTally) -> Iterator[tuple[str, Any]]:
        """The plan's slices in order, scattered rows of one shard in one read (``plan.covering_reads``); with a node
        cache, the next read's shard is fetched while this one is read."""
        reads = covering_reads(plan, self.merge_gap)
        for i, (piece, keep) in enumerate(reads):
            if i + 1 < len(reads) and reads[i + 1][0].shard != piece.shard:
                self._prefetch(reads[i + 1][0].shard)
            yield from self._guarded_slice(piece, policy, keep)

    def merge_gap(self, shard: int) -> int | None:
        """How many unwanted rows one read of ``shard`` may pass over to reach the next wanted ones (None: any)."""
        return None

    def _prefetch(self, shard: int) -> None:
        location, info = self.locations[shard], self.split_info.shards[shard]
        if self.shard_cache is not None and info.sha256 and self.shard_cache.cached(location):
            self.shard_cache.prefetch(location, info.sha256, info.bytes)

    def _cached_copy(self, shard: int) -> Any:
        """A lease on the node-local copy of a shard, or None (no cache, not cached, or no room: read the source)."""
        location, info = self.locations[shard], self.split_info.shards[shard]
        if self.shard_cache is None or not info.sha256 or not self.shard_cache.cached(location):
            return None
        return self.shard_cache.lease(location, info.sha256, info.bytes)

    def _worker_samples(self, epoch: int, worker: int, num_workers: int, skip: int,
                        tally: StageTally | None = None) -> Iterator[Any]:
        c = self.config
        ids = (epoch, c.rank, worker)
        policy = ErrorTally(c, self._state)
        items: Iterator = self._planned_slices(self.worker_plan(epoch, worker, num_workers), policy)
        if c.class_weights is not None:
            items = weighted_windows(items, c.class_weights, c.weight_window,
                                     rng_for(c.seed, STREAM_CLASS_WEIGHTS, *ids))
        if c.shuffle:
            items = shuffle_buffer(items, c.shuffle_buffer, rng_for(c.seed, STREAM_SHUFFLE_BUFFER, *ids))
        if tally is not None:
            items = tally.timed_read(items)
        for position, ((where, sample, row), seed) in enumerate(zip(items, self.sample_seeds(epoch, worker))):
            if position < skip:
                continue
            if isinstance(sample, Broken):
                yield from policy.skipped(where, sample.key, sample.reason)
                continue
            try:
                output = self.decode_row(sample, seed, row) if tally is None \
                    else self._timed_decode(sample, seed, row, tally)
            except CorruptDataError as exc:
                yield from policy.skipped(where, sample.key, reason_of(exc, where))
                continue
            yield from policy.emit(self._pack(output, sample))
        yield from policy.finish(self.config.split)

    def _timed_decode(self, sample: Any, seed: int, row: int, tally: StageTally) -> Any:
        """``decode_row``, its seconds split into decode and transform where the decoder marks the boundary."""
        if not self.decode_timed:
            output = self.decode_row(sample, seed, row)
            tally.sample_done()
            return output
        began = time.perf_counter()
        try:
            return self.decode_row(sample, seed, row)
        finally:
            tally.decoded(began, getattr(self.decode_marker(), "decoded_at", None), time.perf_counter())

    def decode_marker(self) -> Any:
        """The object whose ``decoded_at`` (a ``time.perf_counter()`` value it sets) marks where, inside the last
        decode call, decoding ended and transforming began; None: the whole call counts as decode."""
        return None

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
            wanted = np.zeros(piece.size, dtype=bool)
            wanted[keep] = True
        count = 0
        try:
            for sample in self.read_resync(piece):
                if isinstance(sample, CorruptDataError):
                    if self.config.on_error == "raise":
                        raise sample
                    sample = Broken(sample.key, -1, reason_of(sample, where))
                if wanted is None or wanted[count]:
                    yield where, sample, first + count
                count += 1
            if count < piece.size:
                raise CorruptDataError(f"shard ended after sample {piece.start + count}, the manifest says "
                                       f"{self.split_info.shards[piece.shard].samples}", path=where)
        except CorruptDataError as exc:
            if self.config.on_error == "raise":
                raise
            if count == piece.size:  # found after the last sample (a checksum): nothing left to skip
                log.warning("samples already used from a damaged shard: %s", exc)
            for offset in range(count, piece.size):
                if wanted is None or wanted[offset]:
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

