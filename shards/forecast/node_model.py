"""A node cache played forward over the plan: which shard reads hit, miss, bypass or evict, by the cache's own rules.

The rules are the cache's functions, called with simulated entries instead of files: room and victims by
``shards.cache.eviction.room_for`` (next use in the readers' plans, ``shards.cache.plan_view.next_uses``, or least
recently used), what a reader fetches ahead by ``shards.cache.cached_shards.prefetch_choice``, which shards go
through the cache and their plan entries by ``CachedShards.cached`` and ``planned_runs``. The counters are the ones
``CacheStats`` keeps (hits, misses, bypasses, evictions by reason, fetched, served and bypassed bytes).

What the model fixes that a live node leaves to timing (docs/caching.md, "Forecast"): a prefetch is done before
its reader looks up its own shard, readers take turns read by read in the order their batches are due
(DataLoader's round robin over workers, ranks in step), and a read's lease is held only while it is read. One
reader (one process, one worker) has no turns to take: its counts are the cache's while the cache has room, and
under the limit save where its reader wins the race to the room against its prefetch thread (a hit an epoch).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from shards.cache.cached_shards import PlannedShard, prefetch_choice
from shards.cache.eviction import NEEDED_LATER, NO_ROOM, RESERVED, Entry, room_for
from shards.cache.plan_view import MAX_PLAN_READS, Plan, next_uses

HIT, MISS, BYPASS, LATER = "hit", "miss", "bypass", "later"


class NodeModel:
    """One node's cache: its entries (key -> ``Entry``), the leases readers hold and a clock for least recent use.
    ``limit`` None: no limit (nothing is evicted). ``by_next_use``: the readers' plans steer eviction."""

    def __init__(self, limit: int | None, by_next_use: bool):
        self.limit, self.by_next_use = limit, by_next_use
        self.plans: Callable[[], list[Plan]] = list  # the live readers' plans, set for each epoch
        self.entries: dict[str, Entry] = {}
        self.used = 0  # bytes of the entries
        self.leases: Counter = Counter()
        self.counts: Counter = Counter()
        self._clock = 0.0

    def _tick(self) -> float:
        self._clock += 1.0
        return self._clock

    def acquire(self, key: str, size: int, *, spare_only: bool = False) -> str:
        """``NodeCache.acquire`` on the model: ``HIT``, ``MISS`` (fetched now: the caller counts its requests),
        ``BYPASS`` (read the source) or ``LATER`` (a prefetch refused for now, not counted)."""
        entry = self.entries.get(key)
        if entry is not None:
            self.entries[key] = Entry(key, entry.size, self._tick())
            self.counts.update(hits=1, served_bytes=size)
            return HIT
        if self.limit is not None:
            answer = room_for(key, size, limit=self.limit, entries=list(self.entries.values()),
                              used=self.used, spare_only=spare_only,
                              uses=self._uses, evict=self._evict)
            if answer == NEEDED_LATER:
                return LATER
            if answer == NO_ROOM:
                self.counts.update(bypasses=1, bypassed_bytes=size)
                return BYPASS
            assert answer == RESERVED
        self.entries[key] = Entry(key, size, self._tick())
        self.used += size
        self.counts.update(misses=1, fetched_bytes=size, served_bytes=size)
        return MISS

    def _uses(self) -> Mapping[str, int] | None:
        return next_uses(self.plans()) if self.by_next_use else None

    def _evict(self, entry: Entry, reason: str) -> bool:
        if self.leases[entry.key] > 0:
            return False  # a live reader's lease: the cache passes it over
        del self.entries[entry.key]
        self.used -= entry.size
        self.counts.update(evictions=1, **{f"evictions_{reason}": 1})
        return True


@dataclass
class ReaderModel:
    """One stream's side of the cache (``CachedShards``' per-thread plan): its plan entries this epoch, the next
    epoch's keys, its position, and what it prefetched (location -> (held, size, key))."""

    shards: list[PlannedShard]
    next_keys: list[str]
    reached: int = -1
    ahead_until: int = -1
    pending: dict[str, tuple[bool, int, str]] = field(default_factory=dict)
    reads: tuple[str, ...] = ()  # the published plan's reads (``PlanPublisher.publish``: at most MAX_PLAN_READS)
    epoch_reads: int = 0

    def __post_init__(self) -> None:
        this_epoch = [s.sha256 for s in self.shards][:MAX_PLAN_READS]
        self.reads = tuple([*this_epoch, *self.next_keys[:max(0, MAX_PLAN_READS - len(this_epoch))]])
        self.epoch_reads = len(this_epoch)

    def plan(self) -> Plan:
        """What this reader's plan file says now."""
        return Plan(self.reads, max(0, min(self.reached, len(self.reads))), self.epoch_reads)


def read(node: NodeModel, reader: ReaderModel, index: int, shard: PlannedShard, budget: int,
         on_fetch: Callable[[PlannedShard], None]) -> bool:
    """One read of plan entry ``index`` (``shard``): ``CachedShards.reached`` (what to fetch ahead, and those
    fetches), then ``CachedShards.lease``: the copy prefetched for it, else a lookup now. Whether the read came from
    the cache (else the source). The prefetches go before the reader's own lookup, as the prefetch thread's usually
    do on a live node (it is woken before the reader asks; measured against real runs, ``tests/shards/
    test_forecast.py``): under least recent use a prefetch may then evict the very shard the reader asks for next."""
    if index != reader.reached and 0 <= index < len(reader.shards):
        reader.reached = index
        following, spares, reader.ahead_until = prefetch_choice(
            reader.shards, index, reader.ahead_until, {loc: size for loc, (_, size, _) in reader.pending.items()},
            {loc for loc, (held, _, _) in reader.pending.items() if not held}, budget)
        for ahead, spare_only in [*([(following, False)] if following is not None else []),
                                  *((s, True) for s in spares)]:
            answer = node.acquire(ahead.sha256, ahead.size, spare_only=spare_only)
            if answer == MISS:
                on_fetch(ahead)
            held = answer in (HIT, MISS)
            if held:
                node.leases[ahead.sha256] += 1
            reader.pending[ahead.location] = (held, ahead.size, ahead.sha256)
    pending = reader.pending.pop(shard.location, None)
    if pending is not None and pending[0]:
        node.leases[shard.sha256] -= 1  # the prefetched copy, read, then released
        return True
    answer = node.acquire(shard.sha256, shard.size)
    if answer == MISS:
        on_fetch(shard)
    return answer in (HIT, MISS)


def end_stream(node: NodeModel, reader: ReaderModel) -> None:
    """``CachedShards.end_stream``: prefetched copies not read are released; only the next epoch stays planned."""
    for held, _, key in reader.pending.values():
        if held:
            node.leases[key] -= 1
    reader.pending.clear()
    reader.reached = len(reader.shards)


def live_plans(readers: Sequence[ReaderModel], publishing: bool) -> list[Plan]:
    """Every reader's plan (none when readers publish none: no limit, or eviction by least recent use)."""
    return [reader.plan() for reader in readers] if publishing else []
