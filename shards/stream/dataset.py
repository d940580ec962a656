"""The streaming ``IterableDataset`` family as sources: which rows an epoch has, how to read and decode one.

A dataset says what exists (its split, shard locations, a mixture's or subset's draw, rows left out, class-weight
labels: ``epoch_source``, the one input of the order function ``shards.order.order``) and how to read it (a
reader per kind of shard: ``read_slice``/``read_resync``; a pluggable ``decode_row(sample, seed, row)``, so other
output formats replace one object, not the loop, and no random state is shared between reader and decoder). The
loop between order and batches is ``shards.stream.worker_stream``; where a stream starts, what it skips and what it
keeps out are its loader's (``shards.position.cursor``), handed over as one ``StreamJob``. The dataset itself keeps
only what every loader over it shares with its worker copies: the epoch (``set_epoch``) and the skipped count.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from dataclasses import dataclass

from torch.utils.data import IterableDataset

from shards.cache.cached_shards import CachedShards
from shards.position.elastic import SavedState
from shards.position.shared_blocks import SharedEpochState
from shards.errors import InputError
from shards.manifest import SplitInfo
from shards.stream.options import ErrorPolicy
from shards.order.order import EpochSource, Layout, WorkerOrder, worker_order
from shards.order.plan import (
    STREAM_TRANSFORM, ShardSlice, check_nodes, epoch_sizes, indices_to_slices, rng_for, shard_offsets,
)
from shards.order.reads import CoveringReads
from shards.select.mixture import Mixture
from shards.stream.own_loader import OwnLoader
from shards.stream.worker_stream import StreamJob, StreamState, worker_stream

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


@dataclass(frozen=True, eq=False)
class Selection:
    """What of a split an epoch streams, resolved before the dataset is built (``open_dataset``), so the dataset is
    whole when made: the class names (label = index; a mixture's combined list; None: made without a manifest), a
    mixture's or subset's draw (None: the split's own rows), each shard's label map onto the combined classes,
    each row's label that class weighting draws by (``shards.select.labels``; ``shard_labels``: read from the
    shards when the dataset is built, as a feature folder keeps them) and the resume audit's key columns."""

    classes: tuple[str, ...] | None = None
    mixture: Mixture | None = None
    label_maps: tuple[Any, ...] | None = None
    row_labels: np.ndarray | None = None
    shard_labels: bool = False
    key_columns: Any = None


class ShardDataset(IterableDataset):
    """Base of the family: a split's rows, their epoch source and how to read them; subclasses read slices and
    decode samples. Run-time state belongs to whoever iterates: a loader (``shards.loader.base``) keeps position,
    quarantine and stage seconds and hands each stream its ``StreamJob``; iterated on its own, the dataset is its
    own loader (``shards.stream.own_loader``). ``decode_timed = False``: a subclass whose decode step is no real
    work (features) leaves decode and transform at 0."""

    time_stages = True
    decode_timed = True

    def __init__(self, split: SplitInfo, locations: Sequence[str], config: StreamConfig,
                 num_classes: int | None = None, shard_cache: CachedShards | None = None,
                 selection: Selection = Selection()):
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
        self.shard_sizes = tuple(split.shard_sizes)  # which rows exist: each shard's, in the split's order
        self._first_rows = shard_offsets(self.shard_sizes).tolist()  # each shard's first global row: cache keys
        self.num_classes = num_classes if num_classes is not None else len(split.class_counts)
        # The class names, label = index, as torchvision's ImageFolder has them: from the manifest (a mixture's
        # combined list; empty for a regression table); None for a dataset made without one.
        self.classes = None if selection.classes is None else list(selection.classes)
        self.shared_epoch = SharedEpochState()  # the epoch and the skipped count, shared with worker copies
        self._own = OwnLoader(self)  # iterated on its own: its own loader of one worker and batches of one sample
        self.excluded: np.ndarray | None = None  # global rows left out of every epoch (``exclude_rows``)
        # Each global row's label, which class weighting draws by (``shards.select.labels``; None: no weights).
        self.row_labels = selection.row_labels
        # Each global row's key from the column index, for the resume audit (``shards.select.row_keys``; None: none).
        self.key_columns = selection.key_columns
        if self.sizes.dropped:
            log.info("Sampling(balance='drop') leaves out the last %d sample(s) of %r every epoch", self.sizes.dropped,
                     config.split)
        # Several sources or a subset: the mixture's epochs (``shards.select.mixture``) over the combined split, each
        # shard's labels mapped onto the combined classes (None: the split's own rows and labels).
        self.mixture = selection.mixture
        maps = selection.label_maps
        self.label_maps = None if maps is None or all(m is None for m in maps) else list(maps)
        if self.mixture is not None:
            if config.nodes > 1:
                raise InputError("node affinity (Distributed.nodes) orders whole shards of one dataset; a mixture or "
                                 "subset orders its own runs: leave Distributed.nodes unset")
            self.sizes = epoch_sizes(self.mixture.epoch_size, config.world_size, config.drop_last)

    def __len__(self) -> int:
        return self.sizes.per_rank

    @property
    def epoch(self) -> int:
        return self.shared_epoch.epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch to stream next; reaches DataLoader workers, including persistent ones."""
        self.shared_epoch.epoch = epoch

    @property
    def skipped(self) -> int:
        """Samples skipped as unreadable (``on_error="skip"``), summed over all workers and epochs."""
        return self.shared_epoch.skipped

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
        return self._own.stage_times.snapshot()

    def reset_stage_seconds(self) -> None:
        self._own.stage_times.reset()

    def state_dict(self) -> dict[str, Any]:
        """Progress of in-process iteration (no DataLoader workers); ``make_loader``'s loaders have their own."""
        return self._own.cursor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._own.cursor.load(SavedState.parse(state))

    def epoch_source(self) -> EpochSource:
        return EpochSource.of(self.config, self.shard_sizes, self.mixture, self.excluded, self.row_labels)

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
        return self._own.samples()

    def worker_stream(self, job: StreamJob) -> Iterator[Any]:
        """What ``job``'s logical worker yields in its epoch (``shards.stream.worker_stream``)."""
        return worker_stream(self, job)

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
        return indices_to_slices(rows, shard_offsets(self.shard_sizes))

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

    # -- how a row is read ------------------------------------------------------------------------------------
    def first_row(self, shard: int) -> int:
        """The global row of ``shard``'s first sample."""
        return self._first_rows[shard]

    def merge_gap(self, shard: int) -> int | None:
        """How many unwanted rows one read of ``shard`` may pass over to reach the next wanted ones (None: any)."""
        return None

    def read_ahead(self, reads: CoveringReads, i: int, stream: StreamState) -> None:
        """Start the bytes of covering read ``i`` and the next ones early, where the storage can (image shards)."""

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

    def decode_marker(self) -> Any:
        """A user's decoder that marks where decoding ended by setting ``decoded_at`` on itself (a
        ``time.perf_counter()`` value), or None: without a mark the whole call counts as decode."""
        return None

    def normalizer(self, **options: Any) -> Callable:
        """The per-batch step from what this dataset yields to the model's input (a module: ``.to(device)`` works):
        the identity where samples come ready; a pipeline that leaves work for the consuming device overrides it.
        ``options`` (``dtype``, ``channels_last``) shape a normaliser that has work to do."""
        import torch  # loaded with the IterableDataset already; the name is only needed here

        return torch.nn.Identity()

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

