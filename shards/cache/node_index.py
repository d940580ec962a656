"""The bookkeeping of the node cache's folder (``shards.cache.node``): its layout and flock helpers, the room
entries take under the limit, least-recently-used eviction, the leftovers of killed processes, and the counters.

It is kept apart from fetching and leasing so that every rule deciding what may be deleted, and when, reads in one
place. All of it runs under ``flock`` on files under ``<dir>/v1``, so it holds across processes and a killed holder
never wedges the node:

- ``evict.lock`` (exclusive) is held while the bytes in use are summed (finished entries plus the
  ``reserve/<sha>`` files of fetches in flight) and least-recently-used entries are evicted (by the mtime of their
  ``.ok`` stamp, touched on every hit) until a new shard fits the limit.
- An entry is evicted only when its ``leases/<sha>.lease`` can be locked exclusively without waiting, so a shard
  is never deleted under a live reader. When nothing more can be evicted the fetch is refused rather than
  waited for: a DataLoader whose own workers hold the leases would otherwise deadlock.
- A reservation or temp file whose key's fetch lock (``locks/<sha>.lock``) is free has no live writer and is
  removed; a held fetch lock always protects its files, so a slow live download is never cut.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

from shards.atomic import host_tag
from shards.bounded_read import read_json_file
from shards.lock import pid_alive
from shards.stream.shared_values import SharedValues

log = logging.getLogger("shardcache.cache")

LAYOUT = "v1"
STAMP_SUFFIX = ".ok"
STALE_TMP_S = 3600.0  # a temp file this old is a leftover even when its writer's pid cannot be checked
STAT_NAMES = ("hits", "misses", "fetched_bytes", "served_bytes", "refetches", "evictions", "bypasses")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
ENTRY_PATTERN = re.compile(r"^(?P<sha>[0-9a-f]{64})\.[a-z0-9]{1,8}$")
# Temp files of a shard and of its stamp: ``<final>.<host>.<pid>.<token>.tmp`` (``shards.atomic.unique_tmp_path``).
_TMP = re.compile(r"^(?P<sha>[0-9a-f]{64})\.[a-z0-9]{1,8}(\.ok)?\.(?P<host>[A-Za-z0-9-]{1,32})\.(?P<pid>\d+)"
                  r"\.[0-9a-f]{8}\.tmp$")


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


# -- flock and file helpers ---------------------------------------------------------------------------------------
def open_locked(path: Path, flags: int) -> int | None:
    """An open descriptor holding ``flock(flags)`` on ``path``; None when ``LOCK_NB`` was given and it is held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def locked(path: Path, flags: int = fcntl.LOCK_EX) -> Iterator[bool]:
    """Hold ``flock(flags)`` for the block; yields whether it was taken (False only with ``LOCK_NB``)."""
    fd = open_locked(path, flags)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class CacheIndex:
    """The entries under one cache's ``<dir>/v1`` and the room they take (see the module docstring).

    ``verified`` records the copies this process has checked against their stamps, path -> (size, mtime_ns, inode)
    at that check; every removal goes through ``remove_entry`` so a removed copy is never taken as checked."""

    def __init__(self, root: Path, limit: int | None, stats: CacheStats):
        self.root, self.limit, self.stats = root, limit, stats
        self.verified: dict[str, tuple[int, int, int]] = {}

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

    def remove_entry(self, path: Path) -> None:
        """Stamp first: a copy without its stamp is never used, whatever happens between the two unlinks."""
        self.verified.pop(str(path), None)
        unlink(stamp_path(path))
        unlink(path)

    # -- room ----------------------------------------------------------------------------------------------------
    def reserve(self, sha256: str, size: int) -> bool:
        """Make room for ``size`` more bytes and claim it; False when it cannot be made without waiting."""
        limit = self.limit
        assert limit is not None
        if size > limit:
            return False
        with locked(self.evict_lock):
            entries, used = self._entries(), self.scan_reservations()[0]
            used += sum(entry_size for _, entry_size, _ in entries)
            for _, entry_size, entry in sorted(entries):
                if used + size <= limit:
                    break
                if self._evict(entry):
                    used -= entry_size
            if used + size > limit:
                return False
            record = {"size": size, "host": host_tag(), "pid": os.getpid()}
            (self.root / "reserve" / sha256).write_text(json.dumps(record), encoding="utf-8")
        return True

    def release(self, sha256: str) -> None:
        """Drop the reservation of a fetch that has finished, failed or bypassed (caller holds its fetch lock)."""
        with locked(self.evict_lock):
            unlink(self.root / "reserve" / sha256)

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every copy under its final name; a copy without a stamp sorts first."""
        entries = []
        for folder in self.entry_dirs():
            for entry in os.scandir(folder.path):
                if not ENTRY_PATTERN.match(entry.name):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    size = entry.stat().st_size
                    try:
                        last_use = os.stat(entry.path + STAMP_SUFFIX).st_mtime
                    except FileNotFoundError:
                        last_use = 0.0
                    entries.append((last_use, size, Path(entry.path)))
        return entries

    def scan_reservations(self) -> tuple[int, int]:
        """Bytes claimed by fetches in flight, and how many reservations were left over (caller holds
        ``evict.lock``). A reservation whose fetch lock is free belongs to a killed process and is removed."""
        total = removed = 0
        for entry in os.scandir(self.root / "reserve"):
            if not SHA256_PATTERN.match(entry.name):
                continue
            with locked(self.key_lock(entry.name), fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
                if taken:
                    unlink(Path(entry.path))
                    removed += 1
                    continue
            try:
                total += int(read_json_file(entry.path)["size"])
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError):
                # Cut short by a full disk: its writer is about to remove it, and wrote no shard bytes either.
                continue
        return total, removed

    def _evict(self, path: Path) -> bool:
        match = ENTRY_PATTERN.match(path.name)
        assert match is not None
        with locked(self.lease_file(match["sha"]), fcntl.LOCK_EX | fcntl.LOCK_NB) as unleased:
            if not unleased:
                return False
            self.remove_entry(path)
        self.stats.add(evictions=1)
        log.debug("%s: evicted (least recently used)", path)
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
                    old = now - entry.stat().st_mtime > STALE_TMP_S
                except FileNotFoundError:
                    continue
                if not (dead or old):
                    continue
                with locked(self.key_lock(match["sha"]), fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
                    if taken:
                        unlink(Path(entry.path))
                        removed["temp_files"] += 1
        with locked(self.evict_lock):
            removed["reservations"] = self.scan_reservations()[1]
        if any(removed.values()):
            log.info("%s: removed %d temp file(s) and %d reservation(s) left by killed processes", self.root,
                     removed["temp_files"], removed["reservations"])
        return removed
