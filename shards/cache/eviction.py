"""Which cached shards to evict when the node cache needs room: one pure rule, so it can be tested against an
exhaustive search (docs/caching.md, "The rule").

The inputs are the cached entries, the node's next use of each shard (how many reads ahead of a live reader's
position it is read again, this epoch or the next: ``shards.cache.plan_view``) and the bytes to free. The order:

1. entries no live reader reads again (this epoch or the next), least recently used first (reason ``unneeded``);
2. then the entries read again, the furthest next use first (Belady's rule; reason ``furthest``), ties by least
   recent use.

Without any live plan (a caller that publishes none, or ``ShardCache(eviction="lru")``) the order is least recently
used first (reason ``lru``), as before plans existed.

Unequal sizes: victims are taken in that order until the freed bytes cover the need, the shortest prefix of the
order that does. This is Belady's rule exactly for equal sizes; for unequal ones it is the common greedy
approximation (the exact problem is NP-hard): it may evict a small shard needed late together with a large one,
never one needed sooner than a shard it keeps. ``horizon``: an incoming shard's own next use; an entry needed no later
than it is never a victim (evicting it would trade a read needed sooner for one needed later), which is what stops a
prefetch from evicting what another reader needs first (``math.inf``: only unneeded entries may go).

``room_for`` is the whole answer to "may this shard come in now", victims included, over entries and plans given
as values: the node cache (``shards.cache.node_index.CacheIndex.reserve``) asks it under its lock with the folder's
entries, and the forecast (``shards.forecast.node_model``) asks it with simulated ones, so the forecast's evictions
are the cache's by construction, not a copy of its rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

UNNEEDED, FURTHEST, LRU = "unneeded", "furthest", "lru"
REASONS = (UNNEEDED, FURTHEST, LRU)
# What ``room_for`` answers: room claimed; no room without waiting (read the source); or not now, since the room
# would cost an entry needed sooner than the incoming shard (a prefetch that waits for its turn).
RESERVED, NO_ROOM, NEEDED_LATER = "reserved", "no-room", "needed-later"


@dataclass(frozen=True)
class Entry:
    """A shard copy under its final name: its cache key (sha256), size, last use (the stamp's mtime) and path."""

    key: str
    size: int
    last_use: float
    path: Path | None = None


def eviction_order(entries: Sequence[Entry], next_use: Mapping[str, int] | None,
                   horizon: float | None = None) -> list[tuple[Entry, str]]:
    """Every entry that may be evicted, with its reason, in the order the module docstring gives; ``next_use``
    None: least recently used first. ``horizon``: leave out entries whose next use is at most this."""
    if next_use is None:
        return [(entry, LRU) for entry in sorted(entries, key=lambda e: (e.last_use, e.key))]
    unneeded = sorted((e for e in entries if e.key not in next_use), key=lambda e: (e.last_use, e.key))
    needed = [e for e in entries if e.key in next_use and (horizon is None or next_use[e.key] > horizon)]
    needed.sort(key=lambda e: (-next_use[e.key], e.last_use, e.key))
    return [(entry, UNNEEDED) for entry in unneeded] + [(entry, FURTHEST) for entry in needed]


def choose_victims(entries: Sequence[Entry], next_use: Mapping[str, int] | None, needed_bytes: int,
                   horizon: float | None = None) -> list[tuple[Entry, str]]:
    """The shortest prefix of ``eviction_order`` whose sizes add up to ``needed_bytes`` (all of it when they do not:
    the caller then has no room)."""
    victims, freed = [], 0
    for entry, reason in eviction_order(entries, next_use, horizon):
        if freed >= needed_bytes:
            break
        victims.append((entry, reason))
        freed += entry.size
    return victims


def make_room(entries: Sequence[Entry], uses: Mapping[str, int] | None, needed: int, horizon: float | None,
              evict: Callable[[Entry, str], bool]) -> int:
    """Evict ``choose_victims``'s choice until ``needed`` bytes are free or nothing is left to evict; a victim
    ``evict`` refuses (a leased entry) is passed over and the choice made again without it. The bytes freed."""
    freed, candidates = 0, list(entries)
    while freed < needed:
        victims = choose_victims(candidates, uses, needed - freed, horizon)
        if not victims:
            break
        for entry, reason in victims:
            if evict(entry, reason):
                freed += entry.size
        tried = {id(entry) for entry, _ in victims}
        candidates = [entry for entry in candidates if id(entry) not in tried]
    return freed


def room_for(key: str, size: int, *, limit: int, entries: Sequence[Entry], used: int, spare_only: bool,
             uses: Callable[[], Mapping[str, int] | None], evict: Callable[[Entry, str], bool]) -> str:
    """Whether shard ``key`` of ``size`` bytes may come into a cache of ``limit`` bytes holding ``entries`` and
    ``used`` bytes in all (entries and fetches in flight), evicting through ``evict`` as needed: ``RESERVED``,
    ``NO_ROOM`` or ``NEEDED_LATER``. ``uses``: the live plans' next uses, asked only when room must be made (None:
    no plan, or eviction by least recent use). ``spare_only`` (a prefetch beyond a reader's next shard): only
    entries no live plan reads again may go; otherwise nothing needed no later than the shard itself."""
    if size > limit:
        return NO_ROOM
    horizon: float | None = None
    if used + size > limit:
        next_use = uses()
        horizon = math.inf if spare_only else next_use.get(key) if next_use is not None else None
        if next_use is not None or not spare_only:
            used -= make_room(entries, next_use, used + size - limit, horizon, evict)
    if used + size > limit:
        return NEEDED_LATER if horizon else NO_ROOM
    return RESERVED
