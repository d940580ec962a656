"""One memory-mapped file of uint8 arrays, one slot per sample index, shared by a process and its DataLoader workers.

Why a file, made this way: workers must see what any of them stored (a sample is decoded by whichever worker the
epoch plan deals it to), without a copy per worker, and nothing may outlive the run. MosaicML streaming's named
shared memory is left behind in ``/dev/shm`` when a job is killed (its issues #332, #573). Here the file is made
with ``mkstemp`` (private, mode 0600) in ``/dev/shm`` (or the temp folder when that lacks room) and unlinked at
once, before any pixel is written: only open descriptors and mappings keep it, so the kernel frees it when the last
process holding one exits, however it exits (SIGKILL included). Forked workers inherit the mapping; spawned (and
forkserver) workers get the descriptor passed while they start (``multiprocessing.reduction.DupFd``, as
``multiprocessing.heap`` does for its arenas) and map it again. A copy pickled outside a process start (a deep copy,
a checkpoint) carries no store: it reads as empty and stores nothing.

Layout: a header (bytes used, bytes committed, a full flag), per-worker hit/miss counters, then per sample an
offset, a shape and a state, then the data area. Space is handed out by a bump pointer under ``fcntl.lockf``
(a per-process lock that the kernel drops when its holder dies, so a killed worker cannot wedge the others), and
committed with ``posix_fallocate`` in chunks: a full ``/dev/shm`` is then a refused reservation (the store counts
as full), never a SIGBUS on a page touched later. A sample's state goes from empty to writing (claimed, so two
workers padding the same sample do not both store it) to filled, set after its pixels are written with ``pwrite``
(a system call, so no reader can see the state before the pixels; writing through the file rather than the mapping
also spares a page fault per new page, a third of the cost of keeping a sample).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import tempfile
import weakref
from contextlib import contextmanager
from multiprocessing import context as mp_context
from multiprocessing import reduction
from typing import Iterator

import numpy as np

from shards.procs.values import MAX_WORKERS
from shards.procs.stage_times import worker_slot

EMPTY, WRITING, FILLED = 0, 1, 2
_USED, _COMMITTED, _FULL = range(3)
_HEADER_WORDS = 8
_COUNTER_ROWS = MAX_WORKERS + 1  # as stage_times: one row per DataLoader worker, the last for the main process
HITS, MISSES = range(2)
ALIGN = 64
COMMIT_CHUNK = 64 << 20
SHM = "/dev/shm"
PREFIX = "shardcache-pixels-"

# Outcomes of ``reserve``.
STORED, TAKEN, NO_ROOM, FULL_NOW = range(4)


def _align(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def free_bytes(folder: str) -> int:
    try:
        stats = os.statvfs(folder)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


def choose_folder(size: int, folder: str | None = None) -> str:
    """``folder`` when given; else ``/dev/shm`` when it can take ``size`` bytes, else the temp folder (a file on
    disk, served from the page cache), else whichever has more room (the store then fills up early, and says so)."""
    if folder is not None:
        return folder
    candidates = [c for c in (SHM, tempfile.gettempdir()) if os.path.isdir(c) and os.access(c, os.W_OK)]
    for candidate in candidates:
        if free_bytes(candidate) >= size:
            return candidate
    return max(candidates, key=free_bytes) if candidates else tempfile.gettempdir()


class _Layout:
    """Byte offsets of the parts of a store of ``samples`` slots and ``capacity`` data bytes."""

    def __init__(self, samples: int, capacity: int):
        self.samples, self.capacity = samples, capacity
        self.counters = _HEADER_WORDS * 8
        self.offsets = self.counters + _COUNTER_ROWS * 2 * 8
        self.shapes = self.offsets + samples * 8
        self.states = self.shapes + samples * 3 * 4
        self.data = _align(self.states + samples)
        self.size = self.data + capacity


class SharedArrayStore:
    """uint8 arrays by sample index in a shared, self-deleting mapping; see the module docstring."""

    def __init__(self, samples: int, capacity: int, folder: str | None = None):
        self.layout = _Layout(samples, max(0, int(capacity)))
        self.folder = choose_folder(self.layout.size, folder)
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.folder)
        os.unlink(path)  # from here on only descriptors and mappings keep the memory (see the module docstring)
        try:
            os.ftruncate(fd, self.layout.size)
            os.posix_fallocate(fd, 0, self.layout.data)  # the header and the table, never a SIGBUS
        except OSError:
            os.close(fd)
            raise
        self._attach(fd)

    def _attach(self, fd: int) -> None:
        self._fd = fd
        self._finalizer = weakref.finalize(self, os.close, fd)
        self._map = mmap.mmap(fd, self.layout.size)
        layout, samples = self.layout, self.layout.samples
        self._header = np.frombuffer(self._map, np.int64, _HEADER_WORDS, 0)
        self._counters = np.frombuffer(self._map, np.int64, _COUNTER_ROWS * 2, layout.counters).reshape(-1, 2)
        self._offsets = np.frombuffer(self._map, np.int64, samples, layout.offsets)
        self._shapes = np.frombuffer(self._map, np.int32, samples * 3, layout.shapes).reshape(-1, 3)
        self._states = np.frombuffer(self._map, np.uint8, samples, layout.states)

    @property
    def attached(self) -> bool:
        return getattr(self, "_map", None) is not None

    # -- pickling: the mapping travels to workers as they start, never into copies -----------------------------
    def __getstate__(self) -> dict:
        state = {"layout": self.layout, "folder": self.folder}
        if self.attached and mp_context.get_spawning_popen() is not None:
            state["fd"] = reduction.DupFd(self._fd)
        return state

    def __setstate__(self, state: dict) -> None:
        self.layout, self.folder = state["layout"], state["folder"]
        self._map = None
        if "fd" in state:
            self._attach(state["fd"].detach())

    # -- reading and writing ---------------------------------------------------------------------------------
    def get(self, index: int) -> np.ndarray | None:
        """The array stored for ``index`` (a read-only view of the shared mapping), or None."""
        if not self.attached or self._states[index] != FILLED:
            return None
        view = np.ndarray(tuple(self._shapes[index]), np.uint8, self._map, self.layout.data + int(self._offsets[index]))
        view.flags.writeable = False
        return view

    def put(self, index: int, array: np.ndarray) -> int:
        """Store ``array`` for ``index`` unless another process has claimed it or there is no room: ``STORED``,
        ``TAKEN``, ``NO_ROOM``, or ``FULL_NOW`` (no room, and this call found out first: its caller reports it)."""
        if not self.attached or self._header[_FULL] or self._states[index] != EMPTY:
            return NO_ROOM if self.attached and self._header[_FULL] else TAKEN
        array = np.ascontiguousarray(array, dtype=np.uint8)
        outcome, offset = self._reserve(index, array.shape, array.nbytes)
        if outcome != STORED:
            return outcome
        pixels, at = memoryview(array).cast("B"), self.layout.data + offset
        while len(pixels):  # through the file, not the mapping: no page faults, 3x faster for a new page
            written = os.pwrite(self._fd, pixels, at)
            pixels, at = pixels[written:], at + written
        # The system calls above order the offset, shape and pixels before the state that readers check.
        self._states[index] = FILLED
        return STORED

    def _reserve(self, index: int, shape: tuple[int, ...], nbytes: int) -> tuple[int, int]:
        with self.locked():
            if self._states[index] != EMPTY:
                return TAKEN, 0
            if self._header[_FULL]:
                return NO_ROOM, 0
            start = int(self._header[_USED])
            end = start + _align(nbytes)
            if end > self.layout.capacity or not self._commit(end):
                self._header[_FULL] = 1
                return FULL_NOW, 0
            self._header[_USED] = end
            self._offsets[index] = start
            self._shapes[index] = shape
            self._states[index] = WRITING
            return STORED, start

    def _commit(self, end: int) -> bool:
        """Back the data area up to ``end`` with real pages (in chunks), so writing there cannot fault."""
        committed = int(self._header[_COMMITTED])
        if end <= committed:
            return True
        target = min(self.layout.capacity, max(end, committed + COMMIT_CHUNK))
        try:
            os.posix_fallocate(self._fd, self.layout.data + committed, target - committed)
        except OSError:
            return False
        self._header[_COMMITTED] = target
        return True

    @contextmanager
    def locked(self) -> Iterator[None]:
        fcntl.lockf(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._fd, fcntl.LOCK_UN)

    # -- counters and state ----------------------------------------------------------------------------------
    def count(self, kind: int) -> None:
        """One hit or miss for this process's row (one writer per row: no lock)."""
        if self.attached:
            self._counters[worker_slot(), kind] += 1

    def stats(self) -> dict[str, int]:
        if not self.attached:
            return {"samples": self.layout.samples, "cached": 0, "bytes": 0, "capacity": self.layout.capacity,
                    "hits": 0, "misses": 0, "full": 0}
        totals = self._counters.sum(axis=0)
        return {"samples": self.layout.samples, "cached": int(np.count_nonzero(self._states == FILLED)),
                "bytes": int(self._header[_USED]), "capacity": self.layout.capacity, "hits": int(totals[HITS]),
                "misses": int(totals[MISSES]), "full": int(self._header[_FULL])}

    def close(self) -> None:
        """Let go of this process's mapping and descriptor (the memory goes when every worker has let go too)."""
        if not self.attached:
            return
        mapping = self._map
        self._map = self._header = self._counters = self._offsets = self._shapes = self._states = None
        try:
            mapping.close()
        except BufferError:
            pass  # a caller still holds a view: the mapping goes with it
        self._finalizer()
