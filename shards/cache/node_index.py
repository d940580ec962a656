"""The bookkeeping of the node cache's folder (``shards.cache.node``): its layout, the room entries take under the
limit, eviction (by next use in the readers' plans, ``shards.cache.eviction``), the leftovers of killed processes,
and the counters.

It is kept apart from fetching and leasing so that every rule deciding what may be deleted, and when, reads in one
place. All of it runs under ``flock`` on files under ``<dir>/v1``, so it holds across processes and a killed holder
never wedges the node:

- ``evict.lock`` (exclusive) is held while the bytes in use are summed (finished entries plus the
  ``reserve/<sha>`` files of fetches in flight) and entries are evicted until a new shard fits the limit: those no
  live reader's plan (``shards.cache.plan_view``) reads again first, then the furthest next use; least recently
  used (the mtime of their ``.ok`` stamp, touched on every hit) when no reader publishes a plan.
- An entry is evicted only when its ``leases/<sha>.lease`` can be locked exclusively without waiting, so a shard
  is never deleted under a live reader. When nothing more can be evicted the fetch is refused rather than
  waited for: a DataLoader whose own workers hold the leases would otherwise deadlock.
- A reservation or temp file whose key's fetch lock (``locks/<sha>.lock``) is free has no live writer and is
  removed; a held fetch lock always protects its files, so a slow live download is never cut.

Everything under the folder may have been planted by another job or user (``shards.cache.node_locks``): a lock that
cannot be taken reads as held (no room is made, nothing is removed), a reservation is written only as a new file of
ours (never through a planted link) and counts only when it is a regular file holding a size no larger than the
limit, and only regular files count as entries. Folders are made with the cache folder's own permissions, so a
folder its owner made group- or world-writable (sticky, like ``/tmp``) is shared by every user who may write it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

from shards.atomic import host_tag
from shards.cache.eviction import NO_ROOM, REASONS, RESERVED, Entry, room_for
from shards.cache.node_locks import SHA256_PATTERN, locked, read_cache_json, unlink, warn_once
from shards.cache.plan_view import live_plans, next_uses, remove_dead_plans
from shards.errors import MissingInputError, ShardcacheError
from shards.lock import pid_alive
from shards.door.shape import as_int, as_object
from shards.procs.values import SharedValues

log = logging.getLogger("shardcache.cache")

LAYOUT = "v1"
STAMP_SUFFIX = ".ok"
STALE_TMP_S = 3600.0  # a temp file this old is a leftover even when its writer's pid cannot be checked
# ``evictions`` counts all of them, ``evictions_<reason>`` by reason (``shards.cache.eviction``); ``bypassed_bytes``:
# the size of the shards read from the source for want of room; ``planned_bytes``: the bytes of the distinct cached
# shards each reader's plan reads in its epoch (docs/caching.md, "Counters").
STAT_NAMES = ("hits", "misses", "fetched_bytes", "served_bytes", "refetches", "evictions", "bypasses",
              *(f"evictions_{reason}" for reason in REASONS), "bypassed_bytes", "planned_bytes")
ENTRY_PATTERN = re.compile(r"^(?P<sha>[0-9a-f]{64})\.[a-z0-9]{1,8}\Z")
# Temp files of a shard and of its stamp: ``<final>.<host>.<pid>.<token>.tmp`` (``shards.atomic.unique_tmp_path``).
_TMP = re.compile(r"^(?P<sha>[0-9a-f]{64})\.[a-z0-9]{1,8}(\.ok)?\.(?P<host>[A-Za-z0-9-]{1,32})\.(?P<pid>\d+)"
                  r"\.[0-9a-f]{8}\.tmp\Z")
MAX_RESERVATION_BYTES = 4096  # {"size": ..., "host": ..., "pid": ...} is under 100 bytes
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def ideal_fetch_bytes(planned_bytes: int, limit: int | None, nodes: int = 1) -> int:
    """The bytes an epoch must fetch whatever the eviction rule, from a cache that starts the epoch holding the best
    it can: the bytes its readers planned (``planned_bytes``) that do not fit in ``nodes`` caches of ``limit``
    bytes (docs/caching.md, "Counters"). A cold cache's first epoch fetches all it reads on top of that."""
    return 0 if limit is None else max(0, planned_bytes - limit * nodes)


class CacheStats(SharedValues):
    """Cache counters of a process and its DataLoader workers: one block of shared integers, so the counts of
    workers (forked or spawned) reach the main process, which reports them.

    ``context``: the multiprocessing context of the workers when it is not the default one. A lock made in the
    ``fork`` context (Linux's default before Python 3.14) cannot be handed to a ``spawn`` or ``forkserver``
    worker, so a DataLoader with ``multiprocessing_context="spawn"`` needs ``CacheStats(get_context("spawn"))``.
    """

    def __init__(self, context: BaseContext | None = None) -> None:
        super().__init__("q", len(STAT_NAMES), context=context)

    def add(self, **counts: int) -> None:
        unknown = sorted(set(counts) - set(STAT_NAMES))
        if unknown:
            raise TypeError(f"unknown cache counter(s) {unknown}; known: {list(STAT_NAMES)}")
        with self._array.get_lock():
            for name, count in counts.items():
                self._array[STAT_NAMES.index(name)] += int(count)

    def snapshot(self) -> dict[str, Any]:
        with self._array.get_lock():
            values = dict(zip(STAT_NAMES, (int(v) for v in self._array[:]), strict=True))
        lookups = values["hits"] + values["misses"]
        return {**values, "hit_rate": values["hits"] / lookups if lookups else None}

    def reset(self) -> None:
        with self._array.get_lock():
            self._array[:] = [0] * len(STAT_NAMES)


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


class CacheIndex:
    """The entries under one cache's ``<dir>/v1`` and the room they take (see the module docstring).

    ``verified`` records the copies this process has checked against their stamps, path -> (size, mtime_ns, inode)
    at that check; every removal goes through ``remove_entry`` so a removed copy is never taken as checked."""

    def __init__(self, root: Path, limit: int | None, stats: CacheStats, by_next_use: bool = True):
        self.root, self.limit, self.stats = root, limit, stats
        self.by_next_use = by_next_use  # False: least recently used, whatever the readers' plans say
        self.verified: dict[str, tuple[int, int, int]] = {}
        self.folder_mode: int | None = None  # the cache folder's permission bits, given to the folders made in it

    # -- paths ---------------------------------------------------------------------------------------------------
    def key_lock(self, sha256: str) -> Path:
        return self.root / "locks" / f"{sha256}.lock"

    def lease_file(self, sha256: str) -> Path:
        return self.root / "leases" / f"{sha256}.lease"

    @property
    def evict_lock(self) -> Path:
        return self.root / "evict.lock"

    def entry_dirs(self) -> Iterator[os.DirEntry]:
        for folder in os.scandir(self.root):
            if len(folder.name) == 2 and folder.is_dir(follow_symlinks=False):
                yield folder

    def make_folder(self, path: Path) -> bool:
        """Make ``path`` (one level, with the cache folder's permissions) unless it exists; whether it is a folder
        of this cache: a directory, not a link out of it. ``OSError`` when it cannot be made."""
        try:
            path.mkdir()
            if self.folder_mode is not None:
                os.chmod(path, self.folder_mode)  # mkdir's mode passes through the umask, which drops group bits
        except FileExistsError:
            pass
        return stat.S_ISDIR(os.lstat(path).st_mode)

    def remove_entry(self, path: Path) -> bool:
        """Stamp first: a copy without its stamp is never used, whatever happens between the two unlinks. Whether
        both are gone (False: this process may not remove them, warned once)."""
        self.verified.pop(str(path), None)
        return unlink(stamp_path(path)) and unlink(path)

    # -- room ----------------------------------------------------------------------------------------------------
    def reserve(self, sha256: str, size: int, *, spare_only: bool = False) -> str:
        """Make room for ``size`` more bytes and claim it: ``RESERVED``, ``NO_ROOM`` when it cannot be made without
        waiting, ``NEEDED_LATER`` when the shard is not read now and its room would cost a shard needed sooner.
        ``spare_only`` (a prefetch beyond a reader's next shard): only free room and shards no live plan reads
        again may be used (docs/caching.md, "Prefetch by plan")."""
        limit = self.limit
        assert limit is not None
        if size > limit:
            return NO_ROOM
        with locked(self.evict_lock) as taken:
            if not taken:  # an evict.lock planted by someone else (warned once): no room can be made safely
                return NO_ROOM
            entries = self._entries()
            used = self.scan_reservations({entry.key for entry in entries})[0] + sum(entry.size for entry in entries)
            answer = room_for(sha256, size, limit=limit, entries=entries, used=used, spare_only=spare_only,
                              uses=lambda: next_uses(live_plans(self.root)) if self.by_next_use else None,
                              evict=self._evict)
            if answer != RESERVED:
                return answer
            record = {"size": size, "host": host_tag(), "pid": os.getpid()}
            if not self._write_reservation(self.root / "reserve" / sha256, json.dumps(record).encode()):
                return NO_ROOM
        return RESERVED

    @staticmethod
    def _write_reservation(path: Path, data: bytes) -> bool:
        """``data`` in ``path`` as a new file of this process: whatever was there (a leftover, or a link planted to
        make this process write through it) is removed first, and the new file is never a link's target
        (``O_EXCL``). False when that cannot be done (warned once); a full disk raises."""
        unlink(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise
            warn_once(path, f"cannot reserve room in the node cache ({exc.strerror or exc}); reading the source")
            return False
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return True

    def release(self, sha256: str) -> None:
        """Drop the reservation of a fetch that has finished, failed or bypassed (caller holds its fetch lock)."""
        with locked(self.evict_lock):  # removed even when the lock cannot be taken: the reservation is ours
            unlink(self.root / "reserve" / sha256)

    def _entries(self) -> list[Entry]:
        """Every copy under its final name, with its size and last use (a copy without a stamp: 0, the oldest).
        Only regular files count: a planted link or FIFO is no copy (the next reader of its key replaces it)."""
        entries = []
        for folder in self.entry_dirs():
            for entry in os.scandir(folder.path):
                match = ENTRY_PATTERN.match(entry.name)
                if not match:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    info = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    try:
                        last_use = os.lstat(entry.path + STAMP_SUFFIX).st_mtime
                    except FileNotFoundError:
                        last_use = 0.0
                    entries.append(Entry(match["sha"], info.st_size, last_use, Path(entry.path)))
        return entries

    def scan_reservations(self, placed: frozenset[str] | set[str] = frozenset()) -> tuple[int, int]:
        """Bytes claimed by fetches in flight, and how many reservations were left over (caller holds
        ``evict.lock``). A reservation whose fetch lock is free belongs to a killed process and is removed; one whose
        copy is already ``placed`` under its final name (released a moment later) is counted with the entry only."""
        total = removed = 0
        for entry in os.scandir(self.root / "reserve"):
            if not SHA256_PATTERN.match(entry.name) or entry.name in placed:
                continue
            with locked(self.key_lock(entry.name), fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
                if taken:
                    removed += unlink(Path(entry.path))
                    continue
            total += self._reserved_bytes(Path(entry.path))
        return total, removed

    def _reserved_bytes(self, path: Path) -> int:
        """The size a live fetch's reservation claims; 0 for one that is gone, or is no reservation this cache
        could have written (warned once): not a regular file, not JSON of the right shape, or more than the limit
        (``reserve`` never claims more). A reservation cut short by a full disk is one of those too: its writer is
        about to remove it, and wrote no shard bytes either."""
        try:
            record = as_object(read_cache_json(path, MAX_RESERVATION_BYTES), "the reservation")
            return as_int(record.get("size"), "size", hi=self.limit if self.limit is not None else 1 << 53)
        except MissingInputError:
            return 0
        except ShardcacheError as exc:
            warn_once(path, f"ignored a node-cache reservation: {exc.reason}")
            return 0

    def _evict(self, entry: Entry, reason: str) -> bool:
        assert entry.path is not None
        with locked(self.lease_file(entry.key), fcntl.LOCK_EX | fcntl.LOCK_NB) as unleased:
            if not unleased or not self.remove_entry(entry.path):
                return False
        self.stats.add(evictions=1, **{f"evictions_{reason}": 1})
        log.debug("%s: evicted (%s)", entry.path, reason)
        return True

    # -- leftovers -----------------------------------------------------------------------------------------------
    def clean_stale(self) -> dict[str, int]:
        """Remove temp files and reservations left by killed processes. A temp file counts as left over when its
        writer's pid is dead on this host or it is older than ``STALE_TMP_S``, and in both cases only while no one
        holds its key's fetch lock (so a slow live download is never cut)."""
        host, now = host_tag(), time.time()
        removed = {"temp_files": 0, "reservations": 0}
        for folder in self.entry_dirs():
            for entry in os.scandir(folder.path):
                match = _TMP.match(entry.name)
                if not match:
                    continue
                dead = match["host"] == host and not pid_alive(int(match["pid"]))
                try:
                    old = now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S
                except FileNotFoundError:
                    continue
                if not (dead or old):
                    continue
                with locked(self.key_lock(match["sha"]), fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
                    if taken:
                        removed["temp_files"] += unlink(Path(entry.path))
        with locked(self.evict_lock):
            removed["reservations"] = self.scan_reservations()[1]
        plans = remove_dead_plans(self.root)  # counted apart: a plan is a reader's, not a fetch's leftover
        if any(removed.values()) or plans:
            log.info("%s: removed %d temp file(s), %d reservation(s) and %d plan(s) left by killed processes",
                     self.root, removed["temp_files"], removed["reservations"], plans)
        return removed
