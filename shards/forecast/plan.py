"""The forecast of a run's reads: per epoch and rank, the requests and bytes each storage tier serves, the node
cache's hits and evictions, the time to the first batch and the bill, from the manifest and the plan alone
(docs/caching.md, "Forecast").

Every row a reader reads comes from the one order function (``shards.order.order.worker_order``, over the epoch's
stream built once per epoch), turned into covering reads as the stream turns it (``reads.CoveringReads``); whether a
shard goes through the node cache, and its plan entries, are ``CachedShards``' own answers; the cache is played
forward by ``shards.forecast.node_model`` with the cache's eviction and prefetch functions; each read's requests
follow the transport's rules (``shards.forecast.requests``). So the forecast cannot drift from what a run does
without a test against a real run failing (``tests/s3/test_forecast_s3.py``).

Readers take turns in the order their batches are due: DataLoader asks its workers in turn, ranks go in step, so
the read that holds a worker's row ``p`` is due at batch ``(p // batch_size) * workers + worker``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shards.cache.cached_shards import CachedShards, PlannedShard
from shards.cache.node import NEXT_USE, ShardCache
from shards.errors import InputError
from shards.forecast import node_model
from shards.forecast.prices import Prices
from shards.formats.tarindex import index_size
from shards.forecast.requests import (AheadTable, ShardSpans, Traffic, load_offsets, ranged_sizes,
                                      single_range_sizes, whole_object_sizes)
from shards.loader.loader import resolve_mode
from shards.order.order import EpochSource, Layout, worker_order
from shards.order.plan import check_nodes, shard_offsets
from shards.order.reads import CoveringReads
from shards.position.resume import FEATURE_BATCHES
from shards.transport.location import locate
from shards.transport.s3 import S3Options

FORECAST_FORMAT, FORECAST_VERSION = "shardcache.forecast", 1
CACHE_COUNTS = ("hits", "misses", "bypasses", "evictions", "evictions_unneeded", "evictions_furthest",
                "evictions_lru", "fetched_bytes", "served_bytes", "bypassed_bytes")
WHOLE = 1 << 62  # a whole permutation's first batch may need every row of the reader
MAX_READERS = 1 << 16  # readers (ranks x workers) played an epoch: a few seconds (``_check``)
MAX_READER_EPOCHS = 1 << 18  # and over all epochs


@dataclass(frozen=True)
class Link:
    """The link to storage, for the time to the first batch: ``request_ms`` per round trip and ``mbps`` megabits
    per second for a node (shared by its readers)."""

    request_ms: float = 0.0
    mbps: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.request_ms) and self.request_ms >= 0):
            raise InputError(f"request_ms must be a non-negative number of milliseconds, got {self.request_ms!r}")
        if self.mbps is not None and not (math.isfinite(self.mbps) and self.mbps > 0):
            raise InputError(f"mbps must be a positive number of megabits per second, got {self.mbps!r}")

    def seconds(self, round_trips: int, nbytes: int) -> float:
        rate = None if self.mbps is None else self.mbps * 1e6 / 8
        return round_trips * self.request_ms / 1000 + (0.0 if rate is None else nbytes / rate)


@dataclass
class RankEpoch:
    """What one rank's readers ask of storage in one epoch."""

    rank: int
    samples: int = 0
    reads: int = 0
    source: Traffic = field(default_factory=Traffic)  # every request to the shards' object storage (or server)
    read_ahead: Traffic = field(default_factory=Traffic)  # of those, the slices started before their turn
    index: Traffic = field(default_factory=Traffic)  # of those, the byte-index sidecars
    local: Traffic = field(default_factory=Traffic)  # reads of local (or network file system) files, and bytes
    cache: Counter = field(default_factory=Counter)
    first_batch_s: float | None = None
    # Per reader (worker), the shards of its covering reads in read order: what the loader reads (not in to_dict).
    shard_order: dict[int, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "samples": self.samples, "reads": self.reads,
                               "source": self.source.to_dict(), "read_ahead": self.read_ahead.to_dict(),
                               "index": self.index.to_dict(), "local": self.local.to_dict()}
        if self.cache:
            out["cache"] = {name: int(self.cache[name]) for name in CACHE_COUNTS}
        if self.first_batch_s is not None:
            out["first_batch_s"] = round(self.first_batch_s, 4)
        return out


@dataclass
class Forecast:
    """The forecast of ``epochs`` epochs (``ranks[e][r]``), with what it assumed."""

    dataset: str
    split: str
    samples: int
    shards: int
    shard_bytes: int
    settings: dict[str, Any]
    ranks: list[list[RankEpoch]]
    prices: Prices | None = None

    def epoch_total(self, epoch: int) -> RankEpoch:
        """Epoch ``epoch`` (from 0) over all ranks (first batch: the slowest rank's)."""
        total = RankEpoch(rank=-1)
        for part in self.ranks[epoch]:
            total.samples += part.samples
            total.reads += part.reads
            total.source.merge(part.source)
            total.read_ahead.merge(part.read_ahead)
            total.index.merge(part.index)
            total.local.merge(part.local)
            total.cache.update(part.cache)
            if part.first_batch_s is not None:
                total.first_batch_s = max(total.first_batch_s or 0.0, part.first_batch_s)
        return total

    def cost(self, traffic: Traffic) -> dict[str, float] | None:
        if self.prices is None:
            return None
        return {table.name: round(table.cost(traffic), 6) for table in self.prices.tables}

    def epoch_dict(self, epoch: int) -> dict[str, Any]:
        """Epoch ``epoch`` (from 0) as ``metrics.jsonl`` and the report hold it: the totals and the ranks."""
        total = self.epoch_total(epoch)
        out = {"epoch": epoch + 1, **{k: v for k, v in total.to_dict().items() if k != "rank"},
               "ranks": [part.to_dict() for part in self.ranks[epoch]]}
        cost = self.cost(total.source)
        if cost is not None:
            out["cost"] = cost
        return out

    def to_dict(self) -> dict[str, Any]:
        run = Traffic()
        for epoch in range(len(self.ranks)):
            run.merge(self.epoch_total(epoch).source)
        out: dict[str, Any] = {
            "format": FORECAST_FORMAT, "version": FORECAST_VERSION, "dataset": self.dataset, "split": self.split,
            "samples": self.samples, "shards": self.shards, "shard_bytes": self.shard_bytes,
            "settings": self.settings, "epochs": [self.epoch_dict(e) for e in range(len(self.ranks))],
            "source": run.to_dict()}
        if self.prices is not None:
            out["prices"] = self.prices.to_dict()
            out["cost"] = self.cost(run)
        return out


@dataclass(frozen=True)
class _Reader:
    """One stream of one rank: its covering reads this epoch, when each is due, and (with a node cache) each read's
    place in the stream's cache plan (-1: not cached)."""

    rank: int
    worker: int
    pieces: list[Any]  # the covering reads' ``ShardSlice``s, in read order
    due: list[int]  # per read, the batch at which its first row is due
    rows_before: list[int]  # per read, the rows read before it
    rows: int
    places: np.ndarray | None


def forecast(dataset: Any, mode: Any = None, epochs: int = 1, *, batch_size: int = 256,
             cache: ShardCache | None = None, link: Link | None = None, prices: Prices | None = None,
             read_index: bool = False) -> Forecast:
    """The forecast of ``epochs`` epochs of ``dataset`` (one rank's ``open_dataset``: its ranks, nodes, seed,
    shuffle, shuffle buffer, balance, mixture, subset, class weights and rows left out are the run's, since its
    own ``epoch_source()`` gives every rank's rows) read in run ``mode`` (anything ``RunMode.parse`` reads; None:
    ``make_loader``'s default for the dataset) in batches of ``batch_size``. ``cache``: the node cache the run
    uses (None: none); ``link``: for the time to the first batch; ``prices``: for the bill; ``read_index``: load
    the tar shards' byte indexes (the ``.idx`` sidecars, no shard) for exact slice bytes instead of the estimate."""
    mode = resolve_mode(dataset, mode)
    config, info = dataset.config, dataset.split_info
    kind, split_batch = mode.layout(dataset, batch_size)
    workers = mode.workers
    _check(epochs, config.world_size, workers, batch_size, config.nodes)
    locations = list(dataset.locations)
    places = [locate(text, storage_options=dataset.storage_options) for text in locations]
    indexed = dataset.indexed_shards()
    offsets = load_offsets(places, info.shards) if read_index and any(indexed) else None
    spans = ShardSpans([s.bytes for s in info.shards], [s.samples for s in info.shards], offsets)
    options = S3Options.from_mapping(dataset.storage_options)
    model = _Model(info, locations, places, spans, options, cache, indexed, not mode.restarts_each_epoch, link)
    model.merge_gap = dataset.merge_gap  # the gaps one read passes over, as the dataset's stream merges them
    if model.cache is not None:  # a limit no shard fits in is refused as the run would refuse it
        model.cache.check_limit(max((s.bytes for s in info.shards), default=0), _where(locations))
    source = dataset.epoch_source()
    layout = Layout(config.world_size, config.nodes, max(workers, 1), split_batch, whole=kind == FEATURE_BATCHES)
    # Rows a reader holds before its first batch: its shuffle buffer, or a whole (windowed) permutation's rows.
    buffer = 0 if not config.shuffle else (config.feature_window or WHOLE) if layout.whole else config.shuffle_buffer
    ranks = [model.epoch(source, layout, epoch, workers, batch_size, buffer) for epoch in range(epochs)]
    settings = {"epochs": epochs, "world_size": config.world_size, "nodes": config.nodes,
                "rotate_every": config.rotate_every, "workers": workers, "mode": mode.to_json(),
                "batch_size": batch_size, "seed": config.seed, "shuffle": config.shuffle,
                "drop_last": config.drop_last, "persistent_workers": not mode.restarts_each_epoch,
                "byte_spans": "exact" if spans.exact else "estimate",
                "max_concurrency": options.max_concurrency, "read_ahead_bytes": options.read_ahead_bytes,
                "cache": None if cache is None else {"limit": cache.limit, "eviction": cache.eviction,
                                                     "prefetch_bytes": cache.prefetch_bytes},
                "link": None if link is None else {"request_ms": link.request_ms, "mbps": link.mbps}}
    return Forecast(_where(locations), config.split, info.samples, len(info.shards),
                    sum(s.bytes for s in info.shards), settings, ranks, prices)


def _where(locations: list[str]) -> str:
    """The folders the shards are under, in order (a mixture's several)."""
    return " + ".join(dict.fromkeys(location.rsplit("/", 1)[0] for location in locations)) or "(no shards)"


def _check(epochs: int, world_size: int, workers: int, batch_size: int, nodes: int) -> None:
    for name, value, low in (("epochs", epochs, 1), ("world_size", world_size, 1), ("workers", workers, 0),
                             ("batch_size", batch_size, 1), ("nodes", nodes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InputError(f"{name} must be an integer of at least {low}, got {value!r}")
    check_nodes(nodes, world_size)
    # Every reader (a rank's worker) is played on its own, about 50 us each even when it reads nothing: past these
    # bounds the answer would take minutes (65,536 ranks of 256 workers: 16.7 million readers an epoch).
    readers = world_size * max(workers, 1)
    if readers > MAX_READERS or readers * epochs > MAX_READER_EPOCHS:
        raise InputError(f"{world_size} ranks of {max(workers, 1)} reader(s) over {epochs} epoch(s) is more than "
                         f"the forecast plays: at most {MAX_READERS:,} readers (ranks x workers) an epoch and "
                         f"{MAX_READER_EPOCHS:,} over all epochs; forecast fewer ranks or epochs and scale")


class _Model:
    """The forecast's state across epochs: the nodes' caches and which readers hold which byte indexes."""

    def __init__(self, info: Any, locations: list[str], places: list[Any],
                 spans: ShardSpans, options: S3Options, cache: ShardCache | None, indexed: list[bool],
                 persistent_workers: bool, link: Link | None):
        self.info, self.locations, self.places, self.spans = info, locations, places, spans
        self.options, self.indexed, self.persistent, self.link = options, indexed, persistent_workers, link
        self.offsets = shard_offsets(info.shard_sizes)
        self.merge_gap: Any = lambda shard: 0  # the dataset's (``forecast`` sets it): unwanted rows a read passes
        self.cache = CachedShards(cache) if cache is not None else None
        self.publishing = self.cache is not None and self.cache.plans_ahead
        self.known: dict[int, PlannedShard | None] = {}
        self.nodes: dict[int, node_model.NodeModel] = {}
        self.readers: dict[tuple[int, int], node_model.ReaderModel] = {}
        self.index_loaded: dict[tuple[int, int], set[int]] = {}
        self.remote = [where.local_path() is None for where in places]
        self.remote_at = dict(zip(locations, self.remote))
        # Whether any read may start ahead (``ImageShardDataset._any_read_ahead``): a remote shard read uncached.
        self.reads_ahead = any(indexed[shard] and remote and not self._through_cache(shard)
                               for shard, remote in enumerate(self.remote))

    # -- one epoch -------------------------------------------------------------------------------------------------
    def epoch(self, source: EpochSource, layout: Layout, epoch: int, workers: int, batch_size: int,
              buffer: int) -> list[RankEpoch]:
        stream = source.epoch_stream(epoch, layout.world_size, layout.nodes)
        upcoming = source.epoch_stream(epoch + 1, layout.world_size, layout.nodes) if self.publishing else None
        streams = max(workers, 1)
        per_node = layout.world_size // layout.nodes
        out = [RankEpoch(rank) for rank in range(layout.world_size)]
        for node in range(layout.nodes):
            readers = []
            for rank in range(node * per_node, (node + 1) * per_node):
                for worker in range(streams):
                    readers.append(self._reader(source, layout, epoch, rank, worker, stream, upcoming, batch_size,
                                                streams, out[rank]))
            self._play(node, readers, out, epoch, workers, batch_size, buffer)
        return out

    def _reader(self, source: EpochSource, layout: Layout, epoch: int, rank: int, worker: int, stream: np.ndarray,
                upcoming: np.ndarray | None, batch_size: int, streams: int, tally: RankEpoch) -> _Reader:
        rows = worker_order(source, layout, epoch, rank, worker, stream).rows
        tally.samples += len(rows)
        reads = CoveringReads(rows, self.offsets, self.merge_gap)  # a subset's rows may leave gaps
        pieces = [piece for piece, _ in reads]
        tally.shard_order[worker] = [piece.shard for piece in pieces]
        rows_before = np.concatenate([[0], np.cumsum([piece.size for piece in pieces], dtype=np.int64)])[:-1]
        due = ((rows_before // batch_size) * streams + worker).tolist()
        places = None
        if self.cache is not None:
            read_shards = np.array([piece.shard for piece in pieces], dtype=np.int64)
            entries, places = self.cache.planned_runs(read_shards, self.locations, self.info.shards, self.known)
            next_keys: list[str] = []
            if upcoming is not None:
                later = worker_order(source, layout, epoch + 1, rank, worker, upcoming).rows
                shards = np.searchsorted(self.offsets, later, side="right") - 1
                next_keys = [s.sha256 for s in self.cache.planned_runs(shards, self.locations, self.info.shards,
                                                                        self.known)[0]]
            self.readers[(rank, worker)] = node_model.ReaderModel(entries, next_keys)
        return _Reader(rank, worker, pieces, due, rows_before.tolist(), len(rows), places)

    def _play(self, node: int, readers: list[_Reader], out: list[RankEpoch], epoch: int, workers: int,
              batch_size: int, buffer: int) -> None:
        """Every read of the node's readers in the order they are due, through the node's cache."""
        cache_node = None
        if self.cache is not None:
            models = [self.readers[(r.rank, r.worker)] for r in readers]
            request = self.cache.request
            cache_node = self.nodes.setdefault(node, node_model.NodeModel(request.limit,
                                                                          request.eviction == NEXT_USE))
            cache_node.plans = lambda: node_model.live_plans(models, self.publishing)  # this epoch's readers
        if not self.persistent and workers > 0:  # new worker processes: each loads the byte indexes again
            for reader in readers:
                self.index_loaded.pop((reader.rank, reader.worker), None)
        events = sorted((due, reader.rank, reader.worker, i, k) for k, reader in enumerate(readers)
                        for i, due in enumerate(reader.due))
        ahead = [AheadTable(self.options.read_ahead_bytes) for _ in readers]
        first_batch: dict[int, list[int]] = {}  # rank -> [round trips of its worker 0, bytes of all its readers]
        for _, rank, worker, i, k in events:
            reader, tally = readers[k], out[rank]
            before = (tally.source.requests, tally.source.bytes)
            if self.reads_ahead:
                ahead[k].offer(reader.pieces, i, self.spans, self._through_cache)
            self._read(reader, i, tally, cache_node, ahead[k])
            tally.reads += 1
            if reader.rows_before[i] < min(batch_size + buffer, reader.rows):
                spent = first_batch.setdefault(rank, [0, 0])
                spent[1] += tally.source.bytes - before[1]
                if worker == 0:
                    spent[0] += self._round_trips(tally.source.requests - before[0])
        if cache_node is not None:
            for reader in readers:
                node_model.end_stream(cache_node, self.readers[(reader.rank, reader.worker)])
        if self.link is not None:
            node_bytes = sum(spent[1] for spent in first_batch.values())
            for rank, spent in first_batch.items():
                out[rank].first_batch_s = self.link.seconds(spent[0] + (1 if epoch == 0 else 0), node_bytes)

    def _round_trips(self, requests: int) -> int:
        """Round trips of ``requests`` made together (at most ``max_concurrency`` in flight)."""
        return -(-requests // self.options.max_concurrency) if requests else 0

    # -- one read ----------------------------------------------------------------------------------------------------
    def _read(self, reader: _Reader, i: int, tally: RankEpoch, cache_node: node_model.NodeModel | None,
              ahead: AheadTable) -> None:
        piece = reader.pieces[i]
        if cache_node is not None and reader.places is not None and reader.places[i] >= 0:
            model = self.readers[(reader.rank, reader.worker)]
            planned = self.known[piece.shard]
            assert planned is not None

            def fetched(entry: PlannedShard) -> None:  # the cache copies a whole shard: by parts, or one local read
                if self.remote_at[entry.location]:
                    tally.source.add(whole_object_sizes(entry.size, self.options.max_concurrency))
                else:
                    tally.local.add([entry.size])

            before = Counter(cache_node.counts)
            served = node_model.read(cache_node, model, int(reader.places[i]), planned,
                                     self.cache.request.prefetch_bytes, fetched)
            tally.cache.update(cache_node.counts - before)
            if served:
                if piece.start > 0:  # a slice of the local copy seeks by the byte index, loaded from the source
                    self._load_index(reader, piece.shard, tally)
                return
        self._source_read(reader, i, tally, ahead)

    def _load_index(self, reader: _Reader, shard: int, tally: RankEpoch) -> None:
        info = self.info.shards[shard]
        if not self.indexed[shard] or info.index is None:
            return
        loaded = self.index_loaded.setdefault((reader.rank, reader.worker), set())
        if shard in loaded:
            return
        loaded.add(shard)
        if not self.remote[shard]:
            tally.local.add([index_size(info)])
            return
        sizes = single_range_sizes(index_size(info))
        tally.source.add(sizes)
        tally.index.add(sizes)

    def _source_read(self, reader: _Reader, i: int, tally: RankEpoch, ahead: AheadTable) -> None:
        """A covering read from the shard's own storage: by byte range with the index, else a stream from byte 0."""
        piece = reader.pieces[i]
        shard, info = piece.shard, self.info.shards[piece.shard]
        if not self.remote[shard]:
            tally.local.add([self.spans.span(shard, piece.start, piece.stop)])
            return
        if self.indexed[shard] and info.index is not None:
            self._load_index(reader, shard, tally)
            sizes = ranged_sizes(self.spans.span(shard, piece.start, piece.stop), self.options.max_concurrency)
            tally.source.add(sizes)
            if i in ahead.early:
                tally.read_ahead.add(sizes)
            return
        # A tar without its index streams from byte 0 to the slice's end; an HDF5 slice reads about its own bytes
        sizes = single_range_sizes(self.spans.prefix(shard, piece.stop)) if self.indexed[shard] else \
            ranged_sizes(self.spans.span(shard, piece.start, piece.stop), self.options.max_concurrency)
        tally.source.add(sizes)

    def _through_cache(self, shard: int) -> bool:
        if self.cache is None:
            return False
        if shard not in self.known:
            self.cache.planned_runs(np.array([shard]), self.locations, self.info.shards, self.known)
        return self.known[shard] is not None
