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
  fetches in flight) and evicting least-recently-used entries (by the mtime of their ``.ok`` stamp, touched on
  every hit) until the new shard fits the limit. When nothing more can be evicted the caller reads from the source
  instead (``acquire`` returns ``None``): waiting for readers to finish could deadlock a DataLoader whose own
  workers hold the leases.

A copy is written to a unique temp name, hashed while it is written, checked against the manifest's size and
sha256, fsynced and renamed; then a stamp ``<name>.ok`` records its size, mtime_ns, inode and sha256. Before a
process first uses a copy it compares the file with its stamp; a missing stamp, a partial file or one rewritten
since (size or mtime changed) is deleted and fetched again. The trade-off: rehashing on every use would cost about
a fifth of the raw read speed, so bit rot that keeps size and mtime is not seen on use; ``NodeCache.verify_all``
rehashes every entry (run it from a health check, or after a crash of the node).

Leftover temp files and reservations of killed processes are removed when a cache opens; lock and lease files stay
(removing a lock file someone waits on would let two holders in).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import logging
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import context as mp_context
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, BinaryIO

from shards.atomic import _host_tag, unique_tmp_path, write_json_atomic
from shards.errors import ChecksumError, InputError, ShardcacheError
from shards.units import human_bytes

log = logging.getLogger("shardcache.cache")

LAYOUT = "v1"
STAMP_SUFFIX = ".ok"
STALE_TMP_S = 3600.0  # a temp file this old is a leftover even when its writer's pid cannot be checked
STAT_NAMES = ("hits", "misses", "fetched_bytes", "served_bytes", "refetches", "evictions", "bypasses")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SUFFIX = re.compile(r"^\.[a-z0-9]{1,8}$")
_ENTRY = re.compile(r"^(?P<sha>[0-9a-f]{64})\.[a-z0-9]{1,8}$")
# Temp files of a shard and of its stamp: ``<final>.<host>.<pid>.<token>.tmp`` (``shards.atomic.unique_tmp_path``).
_TMP = re.compile(r"^(?P<sha>[0-9a-f]{64})\.[a-z0-9]{1,8}(\.ok)?\.(?P<host>[A-Za-z0-9-]{1,32})\.(?P<pid>\d+)"
                  r"\.[0-9a-f]{8}\.tmp$")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)
_OK, _MISSING, _BAD = "ok", "missing", "bad"


class CacheFullError(ShardcacheError, OSError):
    """The cache's disk filled up while a shard was written to it (exit code 1). ``errno`` is the cause's
    (``ENOSPC`` or ``EDQUOT``), for callers that test it."""

    def __init__(self, message: str, *, path: str | None = None, cause_errno: int = errno.ENOSPC):
        super().__init__(message, path=path)
        self.errno = cause_errno


@dataclass(frozen=True)
class CacheSettings:
    """Where the node cache lives and how big it may grow. ``fallback``: when the disk is full, read from the
    source instead of failing the job."""

    dir: str
    limit: int | None = None
    fallback: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", os.fspath(self.dir))
        if not self.dir:
            raise InputError("the cache dir must be a folder, got an empty string")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit <= 0):
            raise InputError(f"cache limit must be a positive number of bytes or None, got {self.limit!r}")


class CacheStats:
    """Cache counters of a process and its DataLoader workers: one block of shared integers, so the counts of
    workers (forked or spawned) reach the main process, which reports them.

    ``context``: the multiprocessing context of the workers when it is not the default one. A lock made in the
    ``fork`` context (Linux's default before Python 3.14) cannot be handed to a ``spawn`` or ``forkserver``
    worker, so a DataLoader with ``multiprocessing_context="spawn"`` needs ``CacheStats(get_context("spawn"))``.
    """

    def __init__(self, context: BaseContext | None = None) -> None:
        self._array = (context or multiprocessing).Array("q", len(STAT_NAMES))

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

    def __getstate__(self) -> dict:
        if mp_context.get_spawning_popen() is not None:
            return {"array": self._array}
        # Pickled outside process start-up (a copy, a checkpoint): carry the values, not the shared block.
        return {"values": list(self._array[:])}

    def __setstate__(self, state: dict) -> None:
        if "array" in state:
            self._array = state["array"]
            return
        self._array = multiprocessing.Array("q", len(STAT_NAMES))
        self._array[:] = state["values"]


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


class _HashingWriter(io.RawIOBase):
    """The file object handed to ``fetch``: counts and hashes the bytes on their way to disk, so the copy is
    verified without reading it back, and stops a source that sends more than the manifest says."""

    def __init__(self, handle: BinaryIO, expected_size: int, source: str):
        super().__init__()
        self._handle, self._expected, self._source = handle, expected_size, source
        self.size = 0
        self._digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self.size + view.nbytes > self._expected:
            raise ChecksumError(f"the source sent more than the manifest's {self._expected} bytes", path=self._source)
        self._digest.update(view)
        self._handle.write(view)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _open_locked(path: Path, flags: int) -> int | None:
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
def _locked(path: Path, flags: int = fcntl.LOCK_EX) -> Iterator[bool]:
    """Hold ``flock(flags)`` for the block; yields whether it was taken (False only with ``LOCK_NB``)."""
    fd = _open_locked(path, flags)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_key(sha256: str, suffix: str) -> None:
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        raise InputError(f"a cache key is a sha256 of 64 lowercase hex digits, got {sha256!r}")
    if not isinstance(suffix, str) or not _SUFFIX.match(suffix):
        raise InputError(f"a cached shard's suffix is a dot and 1 to 8 lowercase letters or digits (like '.tar'), "
                         f"got {suffix!r}")


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + STAMP_SUFFIX)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


class NodeCache:
    """The node's shard cache (see the module docstring). Cheap to open; pickles to DataLoader workers."""

    def __init__(self, settings: CacheSettings, stats: CacheStats | None = None):
        self.settings = settings
        self.stats = stats if stats is not None else CacheStats()
        self.root = Path(settings.dir) / LAYOUT
        # Copies this process has checked against their stamps: path -> (size, mtime_ns, inode) at that check.
        self._verified: dict[str, tuple[int, int, int]] = {}
        self._warned_full = False
        try:
            for folder in ("locks", "leases", "reserve"):
                (self.root / folder).mkdir(parents=True, exist_ok=True)
            with _locked(self.root / "evict.lock"):
                pass
        except OSError as exc:
            hint = " (the cache needs a local disk with flock)" if exc.errno in _NO_FLOCK else ""
            raise InputError(f"cannot use the cache folder: {exc.strerror or exc}{hint}", path=settings.dir) from exc
        self.clean_stale()

    # -- paths ---------------------------------------------------------------------------------------------------
    def entry_path(self, sha256: str, suffix: str) -> Path:
        _check_key(sha256, suffix)
        return self.root / sha256[:2] / f"{sha256}{suffix}"

    def _key_lock(self, sha256: str) -> Path:
        return self.root / "locks" / f"{sha256}.lock"

    def _lease_file(self, sha256: str) -> Path:
        return self.root / "leases" / f"{sha256}.lease"

    def _entry_dirs(self) -> Iterator[os.DirEntry]:
        for folder in os.scandir(self.root):
            if len(folder.name) == 2 and folder.is_dir(follow_symlinks=False):
                yield folder

    # -- the public operations -----------------------------------------------------------------------------------
    def check_limit(self, largest_shard_bytes: int, where: str) -> None:
        """Refuse up front a limit no shard of the dataset fits in: otherwise every read of the largest shards
        would silently bypass the cache."""
        limit = self.settings.limit
        if limit is not None and largest_shard_bytes > limit:
            raise InputError(f"the node cache limit {human_bytes(limit)} is smaller than the largest shard of {where} "
                             f"({human_bytes(largest_shard_bytes)}); raise --cache-limit to at least "
                             f"{human_bytes(largest_shard_bytes)} or cache elsewhere", path=self.settings.dir)

    def acquire(self, sha256: str, size: int, suffix: str, fetch: Callable[[BinaryIO], None],
                source: str) -> Lease | None:
        """A lease on the verified local copy of a shard, fetched first if needed; None: read ``source`` directly
        (no room, or a full disk with ``fallback``)."""
        path = self.entry_path(sha256, suffix)
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InputError(f"a shard size is a non-negative number of bytes, got {size!r}", path=source)
        # The lease comes first: once it is held, a copy found below cannot be evicted before the reader opens it.
        lease_fd = _open_locked(self._lease_file(sha256), fcntl.LOCK_SH)
        assert lease_fd is not None
        try:
            if self._check_copy(path, sha256, size) == _OK:
                self._hit(path, size)
                return Lease(path, lease_fd)
            with _locked(self._key_lock(sha256)):
                state = self._check_copy(path, sha256, size)
                if state == _OK:  # another process finished it while this one waited
                    self._hit(path, size)
                    return Lease(path, lease_fd)
                if state == _BAD:
                    log.info("%s: cached copy of %s is partial or was changed; fetching it again", path, source)
                    self.stats.add(refetches=1)
                self._remove_entry(path)
                written = self._fetch(path, sha256, size, fetch, source)
            if written is None:
                self.stats.add(bypasses=1)
                os.close(lease_fd)
                return None
            self.stats.add(misses=1, fetched_bytes=written, served_bytes=size)
            return Lease(path, lease_fd)
        except BaseException:
            os.close(lease_fd)
            raise

    def verify_all(self) -> dict[str, int]:
        """Rehash every entry, as the per-use stamp check does not; remove those whose bytes do not match their
        key or stamp. Entries being fetched right now are skipped."""
        counts = {"checked": 0, "removed": 0, "skipped": 0}
        for folder in self._entry_dirs():
            for entry in os.scandir(folder.path):
                match = _ENTRY.match(entry.name)
                if not match:
                    continue
                path = Path(entry.path)
                with _locked(self._key_lock(match["sha"]), fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
                    if not taken:
                        counts["skipped"] += 1
                        continue
                    counts["checked"] += 1
                    if not self._rehash_matches(path, match["sha"]):
                        log.warning("%s: cached shard does not match its sha256; removed", path)
                        self._remove_entry(path)
                        counts["removed"] += 1
        return counts

    def clean_stale(self) -> dict[str, int]:
        """Remove temp files and reservations left by killed processes. A temp file counts as left over when its
        writer's pid is dead on this host or it is older than ``STALE_TMP_S``, and in both cases only while no one
        holds its key's fetch lock (so a slow live download is never cut)."""
        host, now = _host_tag(), time.time()
        removed = {"temp_files": 0, "reservations": 0}
        for folder in self._entry_dirs():
            for entry in os.scandir(folder.path):
                match = _TMP.match(entry.name)
                if not match:
                    continue
                dead = match["host"] == host and not _pid_alive(int(match["pid"]))
                try:
                    old = now - entry.stat().st_mtime > STALE_TMP_S
                except FileNotFoundError:
                    continue
                if not (dead or old):
                    continue
                with _locked(self._key_lock(match["sha"]), fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
                    if taken:
                        _unlink(Path(entry.path))
                        removed["temp_files"] += 1
        with _locked(self.root / "evict.lock"):
            removed["reservations"] = self._scan_reservations()[1]
        if any(removed.values()):
            log.info("%s: removed %d temp file(s) and %d reservation(s) left by killed processes", self.root,
                     removed["temp_files"], removed["reservations"])
        return removed

    # -- checking a copy -----------------------------------------------------------------------------------------
    def _check_copy(self, path: Path, sha256: str, size: int) -> str:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return _MISSING
        signature = (info.st_size, info.st_mtime_ns, info.st_ino)
        if self._verified.get(str(path)) == signature and info.st_size == size:
            return _OK
        try:
            stamp = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
            recorded = (stamp["size"], stamp["mtime_ns"], stamp["inode"])
            stamped_sha = stamp["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return _BAD
        if recorded != signature or stamped_sha != sha256 or info.st_size != size:
            return _BAD
        self._verified[str(path)] = signature
        return _OK

    def _rehash_matches(self, path: Path, sha256: str) -> bool:
        try:
            stamp = json.loads(_stamp_path(path).read_text(encoding="utf-8"))
            info = os.stat(path)
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                while block := handle.read(1 << 22):
                    digest.update(block)
        except (OSError, ValueError):
            return False
        return (isinstance(stamp, dict) and stamp.get("sha256") == sha256 == digest.hexdigest()
                and (stamp.get("size"), stamp.get("mtime_ns"), stamp.get("inode"))
                == (info.st_size, info.st_mtime_ns, info.st_ino))

    def _hit(self, path: Path, size: int) -> None:
        with contextlib.suppress(OSError):
            os.utime(_stamp_path(path))  # the stamp's mtime is the entry's last use, for LRU eviction
        self.stats.add(hits=1, served_bytes=size)

    def _remove_entry(self, path: Path) -> None:
        """Stamp first: a copy without its stamp is never used, whatever happens between the two unlinks."""
        self._verified.pop(str(path), None)
        _unlink(_stamp_path(path))
        _unlink(path)

    # -- fetching ------------------------------------------------------------------------------------------------
    def _fetch(self, path: Path, sha256: str, size: int, fetch: Callable[[BinaryIO], None], source: str) -> int | None:
        """Write the shard under its final name (caller holds its fetch lock); bytes written, or None to bypass."""
        limited = self.settings.limit is not None
        try:
            if limited and not self._reserve(sha256, size):
                log.debug("%s: no room in the node cache (everything else is being read); reading %s directly",
                          self.root, source)
                return None
            return self._download(path, sha256, size, fetch, source)
        except OSError as exc:
            if isinstance(exc, ShardcacheError) or exc.errno not in _DISK_FULL:
                raise
            if not self.settings.fallback:
                raise CacheFullError(f"no space left on device while caching {source}; set --cache-limit below the "
                                     "free space of that disk, or cache_fallback to read from the source instead",
                                     path=self.settings.dir, cause_errno=exc.errno) from exc
            level = logging.DEBUG if self._warned_full else logging.WARNING
            self._warned_full = True
            log.log(level, "%s: no space left on device; reading shards that do not fit from the source (%s)",
                    self.settings.dir, source)
            return None
        finally:
            if limited:
                with _locked(self.root / "evict.lock"):
                    _unlink(self.root / "reserve" / sha256)

    def _download(self, path: Path, sha256: str, size: int, fetch: Callable[[BinaryIO], None], source: str) -> int:
        path.parent.mkdir(exist_ok=True)
        tmp = unique_tmp_path(path)
        placed = False
        try:
            with open(tmp, "xb") as handle:
                writer = _HashingWriter(handle, size, source)
                fetch(writer)  # type: ignore[arg-type]
                if writer.size != size or writer.hexdigest() != sha256:
                    raise ChecksumError(f"the bytes fetched for the node cache ({writer.size} bytes, sha256 "
                                        f"{writer.hexdigest()}) do not match the manifest ({size} bytes, sha256 "
                                        f"{sha256})", path=source)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            placed = True
            info = os.stat(path)
            write_json_atomic(_stamp_path(path), {"size": info.st_size, "mtime_ns": info.st_mtime_ns,
                                                  "inode": info.st_ino, "sha256": sha256})  # fsyncs the folder
        except BaseException:
            _unlink(tmp)
            if placed:
                self._remove_entry(path)
            raise
        self._verified[str(path)] = (info.st_size, info.st_mtime_ns, info.st_ino)
        return writer.size

    # -- room ----------------------------------------------------------------------------------------------------
    def _reserve(self, sha256: str, size: int) -> bool:
        """Make room for ``size`` more bytes and claim it; False when it cannot be made without waiting."""
        limit = self.settings.limit
        assert limit is not None
        if size > limit:
            return False
        with _locked(self.root / "evict.lock"):
            entries, used = self._entries(), self._scan_reservations()[0]
            used += sum(entry_size for _, entry_size, _ in entries)
            for _, entry_size, entry in sorted(entries):
                if used + size <= limit:
                    break
                if self._evict(entry):
                    used -= entry_size
            if used + size > limit:
                return False
            record = {"size": size, "host": _host_tag(), "pid": os.getpid()}
            (self.root / "reserve" / sha256).write_text(json.dumps(record), encoding="utf-8")
        return True

    def _entries(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every copy under its final name; a copy without a stamp sorts first."""
        entries = []
        for folder in self._entry_dirs():
            for entry in os.scandir(folder.path):
                if not _ENTRY.match(entry.name):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    size = entry.stat().st_size
                    try:
                        last_use = os.stat(entry.path + STAMP_SUFFIX).st_mtime
                    except FileNotFoundError:
                        last_use = 0.0
                    entries.append((last_use, size, Path(entry.path)))
        return entries

    def _scan_reservations(self) -> tuple[int, int]:
        """Bytes claimed by fetches in flight, and how many reservations were left over (caller holds
        ``evict.lock``). A reservation whose fetch lock is free belongs to a killed process and is removed."""
        total = removed = 0
        for entry in os.scandir(self.root / "reserve"):
            if not _SHA256.match(entry.name):
                continue
            with _locked(self._key_lock(entry.name), fcntl.LOCK_EX | fcntl.LOCK_NB) as taken:
                if taken:
                    _unlink(Path(entry.path))
                    removed += 1
                    continue
            try:
                total += int(json.loads(Path(entry.path).read_text(encoding="utf-8"))["size"])
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError):
                # Cut short by a full disk: its writer is about to remove it, and wrote no shard bytes either.
                continue
        return total, removed

    def _evict(self, path: Path) -> bool:
        match = _ENTRY.match(path.name)
        assert match is not None
        with _locked(self._lease_file(match["sha"]), fcntl.LOCK_EX | fcntl.LOCK_NB) as unleased:
            if not unleased:
                return False
            self._remove_entry(path)
        self.stats.add(evictions=1)
        log.debug("%s: evicted (least recently used)", path)
        return True
