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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

UNNEEDED, FURTHEST, LRU = "unneeded", "furthest", "lru"
REASONS = (UNNEEDED, FURTHEST, LRU)


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
