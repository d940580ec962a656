"""Reading shards through the node-local cache: which locations are cached, how each source is fetched whole, and
the prefetch of a worker's next shard.

The cache itself (``shards.cache.node``) knows nothing of sources: it is handed a function that writes a
shard's bytes, here the location's own stream (``shards.formats.location``: ``s3://`` by ranged GETs with retries,
``http(s)://`` as one stream, a path on a network file system as a file copy). This module decides what is worth
caching: every remote location whose bytes can be fetched again by name (object storage, the web), local paths
only on a network file system (NFS, Lustre, CIFS, GPFS, BeeGFS, CephFS, FUSE mounts) unless the caller says
otherwise; ``pipe:`` commands never (their output is not addressable).

A dataset holds a ``CachedShards`` made in the main process (the settings and the counters shared with its
DataLoader workers); each process opens its own ``NodeCache`` and prefetch thread on first use.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence

from shards.cache.node import Lease, NodeCache, ShardCache, check_limit
from shards.cache.node_index import CacheStats
from shards.formats.location import Location, locate
from shards.units import human_bytes

log = logging.getLogger("shardcache.cache")

NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "gpfs", "beegfs",
                        "9p", "afs", "orangefs", "pvfs2", "wekafs", "davfs"})
COPY_CHUNK = 8 << 20


def _mounts() -> list[tuple[str, str]]:
    """``(mount point, file system type)`` of this process's mounts, longest mount point first."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        before, _, after = line.partition(" - ")
        fields = before.split()
        if len(fields) >= 5 and after:
            point = fields[4].encode().decode("unicode_escape")  # \040 for spaces
            mounts.append((point, after.split()[0]))
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)


def on_network_fs(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies on a network or cluster file system (from ``/proc/self/mountinfo``)."""
    target = os.path.realpath(path)
    for point, fstype in _mounts():
        if target == point or target.startswith(point.rstrip("/") + "/"):
            return fstype in NETWORK_FS or fstype.startswith("fuse.")
    return False


class CachedShards:
    """The node cache as a shard reader uses it: ``lease(location, sha256, size)`` -> a local copy (or None: read
    the source), ``prefetch`` of the next shard on a background thread, and the shared counters."""

    def __init__(self, request: ShardCache, storage_options: Any = None, url_origins: Sequence[str] = ()):
        self.request = request
        self.storage_options = storage_options
        self.url_origins = tuple(url_origins)  # where http(s) redirects may lead (locations.request_origins)
        self.stats = CacheStats()
        self._network: dict[str, bool] = {}
        self._process: tuple[int, NodeCache, ThreadPoolExecutor] | None = None
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_process=None, _pending={}, _lock=None)  # per process: made again on first use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def check_limit(self, largest_shard_bytes: int, where: str) -> None:
        check_limit(self.request, largest_shard_bytes, where)

    def _where(self, location: str) -> Location:
        return locate(location, storage_options=self.storage_options, origins=self.url_origins)

    def cached(self, location: str) -> bool:
        """Whether reads of ``location`` go through the cache."""
        where = self._where(location)
        if not where.is_local:
            return where.addressable
        if self.request.local is not None:
            return self.request.local
        folder = os.path.dirname(location)
        if folder not in self._network:
            self._network[folder] = on_network_fs(folder or ".")
        return self._network[folder]

    def _here(self) -> tuple[NodeCache, ThreadPoolExecutor]:
        if self._process is None or self._process[0] != os.getpid():
            if self._lock is None:
                self._lock = threading.Lock()
            self._pending = {}
            self._process = (os.getpid(), NodeCache(self.request, self.stats),
                             ThreadPoolExecutor(1, thread_name_prefix="shardcache-prefetch"))
        return self._process[1], self._process[2]

    def lease(self, location: str, sha256: str, size: int) -> Lease | None:
        """The verified local copy of a shard (fetched now unless prefetched), held until ``release()``; None when
        it cannot be cached (no room, or a full disk with ``fallback``): read the source then."""
        with self._lock:
            pending = self._pending.pop(location, None)
        if pending is not None:
            return pending.result()
        cache, _ = self._here()
        return cache.acquire(sha256, size, _suffix(location), self._fetcher(location), location)

    def prefetch(self, location: str, sha256: str, size: int) -> None:
        """Start fetching a shard a worker will read next, so the download overlaps the current shard's decode."""
        with self._lock:
            if location in self._pending:
                return
        cache, pool = self._here()
        future = pool.submit(cache.acquire, sha256, size, _suffix(location), self._fetcher(location), location)
        with self._lock:
            self._pending[location] = future

    def drop_prefetched(self) -> None:
        """Release leases prefetched for shards that will not be read (the end of an epoch, an error)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            try:
                lease = future.result()
            except Exception:  # noqa: BLE001 - a failed prefetch is reported when the shard is read, not here
                continue
            if lease is not None:
                lease.release()

    def _fetcher(self, location: str) -> Callable[[BinaryIO], None]:
        where = self._where(location)

        def fetch(out: BinaryIO) -> None:
            with where.open() as stream:
                shutil.copyfileobj(stream, out, COPY_CHUNK)
        return fetch

    def summary(self) -> dict[str, Any]:
        """The counters, with the hit rate, for logs and metrics."""
        counts = self.stats.snapshot()
        log.debug("shard cache %s: %s (fetched %s)", self.request.dir, counts, human_bytes(counts["fetched_bytes"]))
        return counts


def _suffix(location: str) -> str:
    suffix = os.path.splitext(location.rstrip("/"))[1].lower()
    return suffix if suffix in (".tar", ".h5", ".pt") else ".bin"
