"""Reading shards through the node-local cache: which locations are cached, how each source is fetched whole, and
the prefetch of a worker's next shard.

The cache itself (``shards.cache.node``) knows nothing of sources: it is handed a function that writes a
shard's bytes, here the location's own stream (``shards.transport.location``: ``s3://`` by ranged GETs with retries,
``http(s)://`` as one stream, a path on a network file system as a file copy). This module decides what is worth
caching: every remote location whose bytes can be fetched again by name (object storage, the web), local paths
only on a network file system (NFS, Lustre, CIFS, GPFS, BeeGFS, CephFS, FUSE mounts) unless the caller says
otherwise; ``pipe:`` commands never (their output is not addressable).

A dataset holds a ``CachedShards`` made in the main process (the settings and the counters shared with its
DataLoader workers); each process opens its own ``NodeCache`` and prefetch thread on first use. The plan is per
stream, and so per thread: the thread run mode (``shards.loader.threads``) runs several streams in threads of one
process over one ``CachedShards``, and each must keep its own plan, position and prefetched leases.

A stream tells it its plan (``plan``: its cached shards in read order, this epoch's and the next's), which is
published for the node's eviction (``shards.cache.plan_view``), and each shard it reaches (``reached``): the
position is published, and shards ahead are fetched on the prefetch thread along the plan: the next one always
(never evicting a shard needed sooner than it), more while the bytes fetched ahead and not yet read stay within
``ShardCache.prefetch_bytes`` and the cache has room to spare. A refused prefetch is fetched when it is read
(docs/caching.md, "Prefetch by plan").
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Callable, NamedTuple, Sequence

import numpy as np

from shards.cache.node import NEXT_USE, Lease, NodeCache, ShardCache, check_limit
from shards.cache.node_index import CacheStats
from shards.cache.plan_view import PlanPublisher
from shards.transport.location import Location, locate
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


class PlannedShard(NamedTuple):
    """A shard in a stream's plan: where it is read from, its cache key and size."""

    location: str
    sha256: str
    size: int


class _StreamPlan:
    """The plan of the stream a thread runs (one at a time): made on the thread's first use, and again in a forked
    process (the parent's plan file and leases are not the child's)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.shards: list[PlannedShard] = []  # this epoch's plan
        self.reached = self.ahead_until = -1  # the plan's shard being read; the last one prefetched
        self.pending: dict[str, tuple[Future, int]] = {}  # location -> (prefetch, bytes)
        self.publisher: PlanPublisher | None = None  # the stream's plan file, kept from one plan to the next

    def __del__(self) -> None:
        # A thread that ended takes its plan with it: its plan file would otherwise stay live (its lock held by
        # this process) and steer the node's eviction for reads no one will make. Never a parent's, after fork.
        if self.publisher is not None and self.pid == os.getpid():
            self.publisher.close()


class CachedShards:
    """The node cache as a shard reader uses it: ``lease(location, sha256, size)`` -> a local copy (or None: read
    the source), a stream's ``plan`` and the prefetch along it on a background thread, and the shared counters.
    The plan and its prefetched leases are the calling thread's stream's; the cache, the prefetch thread and the
    counters are shared by the process's streams."""

    def __init__(self, request: ShardCache, storage_options: Any = None, url_origins: Sequence[str] = ()):
        self.request = request
        self.storage_options = storage_options
        self.url_origins = tuple(url_origins)  # where http(s) redirects may lead (locations.request_origins)
        self.stats = CacheStats()
        self._network: dict[str, bool] = {}
        self._process: tuple[int, NodeCache, ThreadPoolExecutor] | None = None
        self._lock = threading.Lock()  # the making of ``_process``, by whichever stream asks first
        self._plans = threading.local()  # ``.plan``: the calling thread's _StreamPlan

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_plans"]  # per thread, and a thread-local cannot be pickled
        state.update(_process=None, _lock=None)  # per process: made again on first use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._plans = threading.local()

    def check_limit(self, largest_shard_bytes: int, where: str) -> None:
        check_limit(self.request, largest_shard_bytes, where)

    def _where(self, location: str) -> Location:
        return locate(location, storage_options=self.storage_options, origins=self.url_origins)

    def cached(self, location: str) -> bool:
        """Whether reads of ``location`` go through the cache."""
        where = self._where(location)
        if where.local_path() is None:
            return where.addressable
        if self.request.local is not None:
            return self.request.local
        folder = os.path.dirname(location)
        if folder not in self._network:
            self._network[folder] = on_network_fs(folder or ".")
        return self._network[folder]

    def _here(self) -> tuple[NodeCache, ThreadPoolExecutor]:
        process = self._process
        if process is None or process[0] != os.getpid():
            with self._lock:
                process = self._process
                if process is None or process[0] != os.getpid():
                    process = self._process = (os.getpid(), NodeCache(self.request, self.stats),
                                               ThreadPoolExecutor(1, thread_name_prefix="shardcache-prefetch"))
        return process[1], process[2]

    def _mine(self) -> _StreamPlan:
        """The calling thread's stream's plan (a thread inherited across fork starts a new one)."""
        mine = getattr(self._plans, "plan", None)
        if mine is None or mine.pid != os.getpid():
            mine = self._plans.plan = _StreamPlan()
        return mine

    def lease(self, location: str, sha256: str, size: int) -> Lease | None:
        """The verified local copy of a shard (fetched now unless this thread's stream prefetched it), held until
        ``release()``; None when it cannot be cached (no room, or a full disk with ``fallback``): read the source
        then. Another stream's prefetch is never taken: that stream releases it, or reads it, itself."""
        pending = self._mine().pending.pop(location, None)
        if pending is not None:
            lease = pending[0].result()
            if lease is not None:
                return lease
        cache, _ = self._here()  # not prefetched, or the prefetch was refused: fetch it now
        return cache.acquire(sha256, size, _suffix(location), self._fetcher(location), location)

    # -- a stream's plan -----------------------------------------------------------------------------------------
    @property
    def plans_ahead(self) -> bool:
        """Whether streams publish their plans: eviction by next use, and a limit to evict for."""
        return self.request.eviction == NEXT_USE and self.request.limit is not None

    def planned_runs(self, shards: np.ndarray, locations: Sequence[str], infos: Sequence[Any],
                     known: dict[int, PlannedShard | None]) -> tuple[list[PlannedShard], np.ndarray]:
        """The runs of one shard in ``shards`` (shard numbers in read order; ``locations`` and manifest ``infos``
        by number) that go through the cache, as plan entries, and per element its run's place among them (-1: not
        cached). ``known``: the entries of the shards looked up so far (a location is checked once)."""
        if not len(shards):
            return [], np.zeros(0, dtype=np.int64)
        starts = np.flatnonzero(np.concatenate([[True], shards[1:] != shards[:-1]]))
        runs = []
        for shard in shards[starts].tolist():
            if shard not in known:
                location, info = locations[shard], infos[shard]
                known[shard] = PlannedShard(location, info.sha256, info.bytes) \
                    if info.sha256 and self.cached(location) else None
            runs.append(known[shard])
        cached_runs = np.array([run is not None for run in runs])
        place_of_run = np.where(cached_runs, np.cumsum(cached_runs) - 1, -1)
        lengths = np.diff(np.concatenate([starts, [len(shards)]]))
        return [run for run in runs if run is not None], np.repeat(place_of_run, lengths)

    def plan(self, shards: Sequence[PlannedShard], next_epoch: Sequence[str]) -> None:
        """The calling thread's stream begins: ``shards``, its cached shards in read order (one per run of reads of
        a shard), and ``next_epoch``, the keys its next epoch reads in order. Published for the node's eviction by
        next use. Replaces this thread's last plan only; other threads' streams keep theirs."""
        cache, _ = self._here()
        self.drop_prefetched()
        mine = self._mine()
        mine.shards, mine.reached, mine.ahead_until = list(shards), -1, -1
        self.stats.add(planned_bytes=sum({s.sha256: s.size for s in mine.shards}.values()))
        if self.plans_ahead:
            if mine.publisher is None:
                mine.publisher = PlanPublisher(cache.root)
            mine.publisher.publish([s.sha256 for s in mine.shards], next_epoch)

    def reached(self, index: int) -> None:
        """The calling thread's stream's read of ``plan``'s shard ``index`` begins: publish the position and
        prefetch ahead, the next shard always (its room may cost shards needed later than it), more within
        ``prefetch_bytes`` (per stream) and only in room to spare (``CacheIndex.reserve``); after a refusal, no more
        until the refused shard is read."""
        mine = self._mine()
        if index == mine.reached or not 0 <= index < len(mine.shards):
            return
        mine.reached = index
        if mine.publisher is not None:
            mine.publisher.advance(index)
        following, spares, mine.ahead_until = prefetch_choice(
            mine.shards, index, mine.ahead_until, {location: size for location, (_, size) in mine.pending.items()},
            {location for location, (future, _) in mine.pending.items() if _refused(future)},
            self.request.prefetch_bytes)
        if following is not None:
            self._prefetch(mine, following, spare_only=False)
        for shard in spares:
            self._prefetch(mine, shard, spare_only=True)

    def end_stream(self) -> None:
        """The calling thread's stream ended or stopped: release what was prefetched for it; only its next epoch
        stays planned. Other threads' streams go on untouched."""
        self.drop_prefetched()
        mine = self._mine()
        if mine.publisher is not None:
            mine.publisher.finish_epoch()
        mine.shards, mine.reached, mine.ahead_until = [], -1, -1

    def _prefetch(self, mine: _StreamPlan, shard: PlannedShard, *, spare_only: bool) -> None:
        cache, pool = self._here()
        future = pool.submit(cache.acquire, shard.sha256, shard.size, _suffix(shard.location),
                             self._fetcher(shard.location), shard.location, spare_only=spare_only)
        mine.pending[shard.location] = (future, shard.size)

    def drop_prefetched(self) -> None:
        """Release the leases the calling thread's stream prefetched for shards it will not read (the end of an
        epoch, an error); other streams' prefetches stay theirs."""
        mine = self._mine()
        pending, mine.pending = mine.pending, {}
        for future, _ in pending.values():
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


def prefetch_choice(shards: Sequence[PlannedShard], index: int, ahead_until: int, pending: dict[str, int],
                    refused: set[str], budget: int) -> tuple[PlannedShard | None, list[PlannedShard], int]:
    """What a stream fetches ahead when its read of plan entry ``index`` begins (``CachedShards.reached``): the next
    shard when it differs from this one and is not pending already (or its prefetch was refused), then later ones
    along the plan while the bytes pending ahead stay within ``budget``, none while a refused prefetch is pending.
    ``pending``: the locations prefetched and not yet read, with their sizes; ``ahead_until``: the last entry
    prefetched. Pure, so the forecast (``shards.forecast.node_model``) prefetches as the cache does.
    Returns (the next shard or None, the shards fetched ahead in room to spare, the new ``ahead_until``)."""
    current = shards[index].location
    pending_now = dict(pending)
    waiting = set(refused)
    following = None
    if index + 1 < len(shards) and shards[index + 1].location != current:
        candidate = shards[index + 1]
        if candidate.location not in pending or candidate.location in refused:
            following = candidate  # refused as a prefetch far ahead: now it is the next one
            pending_now[candidate.location] = candidate.size
            waiting.discard(candidate.location)
        ahead_until = max(ahead_until, index + 1)
    spares: list[PlannedShard] = []
    if waiting & set(pending_now):
        return following, spares, ahead_until
    ahead = sum(size for location, size in pending_now.items() if location != current)
    for later in range(max(index + 2, ahead_until + 1), len(shards)):
        shard = shards[later]
        if shard.location == current or shard.location in pending_now:
            continue
        if ahead + shard.size > budget:
            break
        spares.append(shard)
        pending_now[shard.location] = shard.size
        ahead += shard.size
        ahead_until = later
    return following, spares, ahead_until


def _refused(future: Future | None) -> bool:
    """Whether a prefetch finished without a copy (the cache refused it, or had no room)."""
    return future is not None and future.done() and future.exception() is None and future.result() is None


def _suffix(location: str) -> str:
    suffix = os.path.splitext(location.rstrip("/"))[1].lower()
    return suffix if suffix in (".tar", ".h5", ".pt") else ".bin"
