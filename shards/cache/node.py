"""A node-local cache of whole shards, shared by every rank and DataLoader worker on a node.

Shards live on NFS/Lustre or S3, and without a cache every epoch streams the whole dataset over the network again.
Here each shard is copied once to the node's local disk and read from there. Entries are keyed by the manifest's
sha256, ``<dir>/v1/<sha[:2]>/<sha256><suffix>``, so a repacked dataset never reads stale bytes and two datasets
can share one folder.

Processes coordinate only through ``flock`` on files under ``<dir>/v1`` (the kernel drops a lock when its holder
dies, so a killed worker never wedges the node):

- ``locks/<sha>.lock`` (exclusive) around fetching one shard: exactly one process downloads it, the others block on
  the lock and then find the finished copy.
- ``leases/<sha>.lease`` (shared) for as long as a reader holds a ``Lease``. Eviction removes only entries whose
  lease it can lock exclusively without waiting, so a shard is never deleted under a live reader. Locks taken
  through different open file descriptions conflict even inside one process, so a lease held by this process
  protects its entry from this process's own evictions too.
- ``evict.lock`` (exclusive) around computing the bytes in use (finished entries plus ``reserve/<sha>`` files of
  fetches in flight) and evicting entries until the new shard fits the limit: by next use in the plans the
  node's readers publish under ``plans/`` (``shards.cache.plan_view``, ``shards.cache.eviction``), else least
  recently used (by the mtime of their ``.ok`` stamp, touched on every hit). When nothing more can be evicted the
  caller reads from the source instead (``acquire`` returns ``None``): waiting for readers to finish could
  deadlock a DataLoader whose own workers hold the leases. A prefetch is not cached (also None) when its room would
  cost a shard some reader needs sooner.

A copy is written to a unique temp name, hashed while it is written, checked against the manifest's size and
sha256, fsynced and renamed; then a stamp ``<name>.ok`` records its size, mtime_ns, inode and sha256. Before a
process first uses a copy it compares the file with its stamp (a missing stamp, a partial file or one rewritten
since, size or mtime changed, is deleted and fetched again), then rehashes the whole copy against the manifest's
sha256: a copy changed in place with its size and mtime kept (bit rot, or a hand on the node's disk) is dropped
with a warning naming the shard, and fetched again. The hash runs once per process per copy, remembered by (path,
size, mtime_ns, inode), before the lease is handed out: a reader takes slices by seeking, so a check while
streaming would cover only whole-shard reads, and checking first means no byte of a bad copy is ever served. It
costs one read of the copy, which also warms the page cache for the reads that follow (``scripts/bench/cache.py
--verify-cost``); ``NodeCache.verify_all`` rehashes every entry at once (a health check, or after a node crash).

Leftover temp files and reservations of killed processes are removed when a cache opens; lock and lease files stay
(removing a lock file someone waits on would let two holders in). This module fetches and leases copies;
``shards.cache.node_copies`` checks and writes a copy, ``shards.cache.node_index`` keeps the room, eviction and
leftovers.

The folder may be shared with other jobs and users, so anything in it may have been planted
(``shards.cache.node_locks``): a lease or fetch lock that cannot be taken, an entry folder that is a link, a copy or
stamp that cannot be removed, a folder this user may not write in: the shard is read from the source (``acquire``
returns None, counted as a bypass) with one warning per file, never a crash. Only a regular file, never a link, is
a copy; it is hashed through a non-blocking open (``shards.door.bounded_read.open_regular_file``), so a FIFO cannot hang
``verify_all`` either.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# The folder's layout, locks, room and counters live in node_index; a copy's checks and writing in node_copies.
from shards.cache.eviction import NEEDED_LATER, RESERVED
from shards.cache.node_copies import COPY_BAD, COPY_CORRUPT, COPY_OK, DISK_FULL, NOT_A_FOLDER, UNUSABLE, Copies
from shards.cache.node_index import ENTRY_PATTERN, LAYOUT, CacheIndex, CacheStats, stamp_path
from shards.cache.node_locks import SHA256_PATTERN, locked, open_locked, warn_once
from shards.cache.plan_view import PLANS
from shards.errors import InputError, ShardcacheError
from shards.units import human_bytes, parse_size

log = logging.getLogger("shardcache.cache")

_SUFFIX = re.compile(r"^\.[a-z0-9]{1,8}\Z")
_DISK_FULL_FALLBACK = "disk-full"
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)
NEXT_USE, LRU = "next-use", "lru"
EVICTION_RULES = (NEXT_USE, LRU)
# Two 128 MiB shards, or one past the next of ImageNet-size tar shards: enough to keep a link busy across a shard
# boundary, small beside any limit a dataset bigger than the disk is given (docs/caching.md, "Prefetch by plan").
DEFAULT_PREFETCH_BYTES = 256 << 20


class CacheFullError(ShardcacheError, OSError):
    """The cache's disk filled up while a shard was written to it (exit code 1). ``errno`` is the cause's
    (``ENOSPC`` or ``EDQUOT``), for callers that test it."""

    def __init__(self, message: str, *, path: str | None = None, cause_errno: int = errno.ENOSPC):
        super().__init__(message, path=path)
        self.errno = cause_errno


@dataclass(frozen=True)
class ShardCache:
    """The node-local shard cache a caller asks for (``open_dataset(remote=Remote(shard_cache=...))``): the folder
    (None: no cache; the CLIs default it to ``$SHARDCACHE_CACHE_DIR``), at most ``limit`` bytes (or ``"200G"``),
    whether a full disk falls back to reading the source (``fallback``) instead of failing the job, whether local paths
    are cached (``local``; None: only those on a network file system, see ``shards.cache.cached_shards``), the
    eviction rule and the prefetch budget (docs/caching.md)."""

    dir: str | os.PathLike | None = None
    limit: int | str | None = None
    fallback: bool = False
    local: bool | None = None
    # Which entry goes when room is needed (``shards.cache.eviction``): "next-use" in the readers' plans, or "lru".
    eviction: str = NEXT_USE
    # Bytes a reader fetches ahead of its reads along its plan, beyond the next shard (always fetched ahead).
    prefetch_bytes: int | str = DEFAULT_PREFETCH_BYTES

    def __post_init__(self) -> None:
        if self.eviction not in EVICTION_RULES:
            raise InputError(f"ShardCache.eviction={self.eviction!r} is not one of {', '.join(EVICTION_RULES)}")
        object.__setattr__(self, "prefetch_bytes", parse_size(self.prefetch_bytes, "ShardCache.prefetch_bytes"))
        if self.dir is not None:
            object.__setattr__(self, "dir", os.fspath(self.dir))
            if not self.dir:
                raise InputError("ShardCache.dir must name a folder, got an empty string")
        if self.limit is not None:
            object.__setattr__(self, "limit", parse_size(self.limit, "ShardCache.limit"))
            if self.limit <= 0:
                raise InputError(f"ShardCache.limit must be a positive number of bytes or None, got {self.limit}")


class Lease:
    """A reader's shared lock on one cached shard: while it is held, no process on the node evicts the file.

    A process forked while it holds a lease shares the lock until it, too, closes the descriptor."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        # A lease dropped without release would pin its entry until this process exits.
        with contextlib.suppress(Exception):
            self.release()


def _check_key(sha256: str, suffix: str) -> None:
    if not isinstance(sha256, str) or not SHA256_PATTERN.match(sha256):
        raise InputError(f"a cache key is a sha256 of 64 lowercase hex digits, got {sha256!r}")
    if not isinstance(suffix, str) or not _SUFFIX.match(suffix):
        raise InputError(f"a cached shard's suffix is a dot and 1 to 8 lowercase letters or digits (like '.tar'), "
                         f"got {suffix!r}")


def check_limit(settings: Any, largest_shard_bytes: int, where: str) -> None:
    """Refuse up front a limit no shard of the dataset fits in: otherwise every read of the largest shards would
    silently bypass the cache. Needs only the settings, so a dataset checks it without opening the cache folder."""
    limit = settings.limit
    if limit is not None and largest_shard_bytes > limit:
        raise InputError(f"the node cache limit {human_bytes(limit)} is smaller than the largest shard of {where} "
                         f"({human_bytes(largest_shard_bytes)}); raise --cache-limit to at least "
                         f"{human_bytes(largest_shard_bytes)} or cache elsewhere", path=settings.dir)


class NodeCache:
    """The node's shard cache (see the module docstring). Cheap to open; pickles to DataLoader workers.

    Fetching and leasing copies happen here; a ``Copies`` (``shards.cache.node_copies``) checks and writes a copy,
    a ``CacheIndex`` (``shards.cache.node_index``) keeps the folder's room, eviction and leftovers."""

    def __init__(self, settings: ShardCache, stats: CacheStats | None = None):
        if settings.dir is None:
            raise InputError("a node cache needs ShardCache.dir")
        self.settings = settings
        self.stats = stats if stats is not None else CacheStats()
        self.root = Path(settings.dir) / LAYOUT
        self._index = CacheIndex(self.root, settings.limit, self.stats, by_next_use=settings.eviction == NEXT_USE)
        self._copies = Copies(self._index)
        self._warned_full = False
        try:
            Path(settings.dir).mkdir(parents=True, exist_ok=True)
            self._index.folder_mode = stat.S_IMODE(os.stat(settings.dir).st_mode)
            for folder in (self.root, *(self.root / name for name in ("locks", "leases", "reserve", PLANS))):
                if not self._index.make_folder(folder):
                    raise InputError(f"cannot use the cache folder: {folder} is not a folder (a link or a file)",
                                     path=settings.dir)
            with locked(self._index.evict_lock):
                pass
        except OSError as exc:
            hint = " (the cache needs a local disk with flock)" if exc.errno in _NO_FLOCK else ""
            raise InputError(f"cannot use the cache folder: {exc.strerror or exc}{hint}", path=settings.dir) from exc
        self.clean_stale()

    def entry_path(self, sha256: str, suffix: str) -> Path:
        _check_key(sha256, suffix)
        return self.root / sha256[:2] / f"{sha256}{suffix}"

    # -- the public operations -----------------------------------------------------------------------------------
    def check_limit(self, largest_shard_bytes: int, where: str) -> None:
        check_limit(self.settings, largest_shard_bytes, where)

    def acquire(self, sha256: str, size: int, suffix: str, fetch: Callable[[BinaryIO], None],
                source: str, *, spare_only: bool = False) -> Lease | None:
        """A lease on the verified local copy of a shard, fetched first if needed; None: read ``source`` directly
        (no room, or a full disk with ``fallback``). ``spare_only``: a prefetch far ahead, cached only in room to
        spare (``CacheIndex.reserve``), else None without counting a bypass."""
        path = self.entry_path(sha256, suffix)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InputError(f"a shard size is a non-negative number of bytes, got {size!r}", path=source)
        # The lease comes first: once it is held, a copy found below cannot be evicted before the reader opens it.
        lease_fd = open_locked(self._index.lease_file(sha256), fcntl.LOCK_SH) if self._folder_ok(path) else None
        if lease_fd is None:  # a planted lease or folder (warned once): nothing here can be trusted or protected
            self.stats.add(bypasses=1, bypassed_bytes=size)
            return None
        try:
            if self._copies.check(path, sha256, size) == COPY_OK:
                self._hit(path, size)
                return Lease(path, lease_fd)
            with locked(self._index.key_lock(sha256)) as taken:
                written = self._fill(path, sha256, size, fetch, source, spare_only) if taken else UNUSABLE
            if written == COPY_OK:  # another process finished it while this one waited
                self._hit(path, size)
                return Lease(path, lease_fd)
            if isinstance(written, str):  # nothing cached: read the source, or (a prefetch) fetch it when read
                if written != NEEDED_LATER:
                    self.stats.add(bypasses=1, bypassed_bytes=size)
                os.close(lease_fd)
                return None
            self.stats.add(misses=1, fetched_bytes=written, served_bytes=size)
            return Lease(path, lease_fd)
        except BaseException:
            os.close(lease_fd)
            raise

    @staticmethod
    def _folder_ok(path: Path) -> bool:
        """Whether the entry's folder ``v1/<xx>`` is one of the cache's (or not made yet): a link planted in its
        place is never followed, for reading, removing or writing (warned once)."""
        try:
            mode = os.lstat(path.parent).st_mode
        except FileNotFoundError:
            return True
        if stat.S_ISDIR(mode):
            return True
        warn_once(path.parent, NOT_A_FOLDER)
        return False

    def _fill(self, path: Path, sha256: str, size: int, fetch: Callable[[BinaryIO], None], source: str,
              spare_only: bool) -> int | str:
        """Under the key's fetch lock: ``COPY_OK`` when a finished copy is there now, else what ``_fetch`` says
        (bytes written, or why nothing was); ``UNUSABLE`` when what stands under the copy's name cannot be removed."""
        state = self._copies.check(path, sha256, size)
        if state == COPY_OK:
            return COPY_OK
        if state == COPY_BAD:
            log.info("%s: cached copy of %s is partial or was changed; fetching it again", path, source)
            self.stats.add(refetches=1)
        elif state == COPY_CORRUPT:
            log.warning("%s: the node cache's copy of this shard (%s) does not match its sha256 (changed in "
                        "place on the node's disk); removed, fetching it again", source, path)
            self.stats.add(refetches=1)
        if not self._remove_entry(path):
            return UNUSABLE
        return self._fetch(path, sha256, size, fetch, source, spare_only)

    def verify_all(self) -> dict[str, int]:
        """Rehash every entry now (a process rehashes a copy only when it first uses it); remove those whose bytes
        do not match their key or stamp. Entries being fetched right now are skipped."""
        counts = {"checked": 0, "removed": 0, "skipped": 0}
        for folder in self._index.entry_dirs():
            for entry in os.scandir(folder.path):
                match = ENTRY_PATTERN.match(entry.name)
                if not match:
                    continue
                path = Path(entry.path)
                with locked(self._index.key_lock(match["sha"]), fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
                    if not taken:
                        counts["skipped"] += 1
                        continue
                    counts["checked"] += 1
                    if not self._copies.rehash_matches(path, match["sha"]) and self._remove_entry(path):
                        log.warning("%s: cached shard does not match its sha256; removed", path)
                        counts["removed"] += 1
        return counts

    def clean_stale(self) -> dict[str, int]:
        """Remove temp files and reservations left by killed processes (``CacheIndex.clean_stale``)."""
        return self._index.clean_stale()

    def _hit(self, path: Path, size: int) -> None:
        with contextlib.suppress(OSError):  # another user's stamp is theirs to touch
            os.utime(stamp_path(path), follow_symlinks=False)  # the stamp's mtime is the entry's last use (LRU)
        self.stats.add(hits=1, served_bytes=size)

    def _remove_entry(self, path: Path) -> bool:
        return self._index.remove_entry(path)

    # -- fetching ------------------------------------------------------------------------------------------------
    def _fetch(self, path: Path, sha256: str, size: int, fetch: Callable[[BinaryIO], None], source: str,
               spare_only: bool = False) -> int | str:
        """Write the shard under its final name (caller holds its fetch lock); bytes written, or why nothing was
        (``CacheIndex.reserve``'s answer, or ``_DISK_FULL_FALLBACK``)."""
        limited = self.settings.limit is not None
        try:
            if limited:
                answer = self._index.reserve(sha256, size, spare_only=spare_only)
                if answer != RESERVED:
                    log.debug("%s: %s for %s in the node cache", self.root, answer, source)
                    return answer
            return self._copies.download(path, sha256, size, fetch, source)
        except OSError as exc:
            if isinstance(exc, ShardcacheError) or exc.errno not in DISK_FULL:
                raise
            if not self.settings.fallback:
                raise CacheFullError(f"no space left on device while caching {source}; set --cache-limit below the "
                                     "free space of that disk, or --cache-fallback (ShardCache.fallback) to read "
                                     "from the source instead",
                                     path=self.settings.dir, cause_errno=exc.errno) from exc
            level = logging.DEBUG if self._warned_full else logging.WARNING
            self._warned_full = True
            log.log(level, "%s: no space left on device; reading shards that do not fit from the source (%s)",
                    self.settings.dir, source)
            return _DISK_FULL_FALLBACK
        finally:
            if limited:
                self._index.release(sha256)
