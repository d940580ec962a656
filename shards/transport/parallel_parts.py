"""Parallel ranged reads: bytes ``[start, stop)`` of one object fetched as parts over several connections at once
and handed back in order as one readable stream, and the read-ahead table that lets a reader start the next ranges
of its plan before it reaches them (docs/object-storage.md, "Throughput over a real link").

Why: a real object store answers each request in tens of milliseconds and one connection carries 50-100 MB/s, so a
reader with one request in flight gets one connection's rate whatever the link holds. This module knows nothing of
schemes: a caller (``shards.transport.s3_parallel``, ``shards.transport.remote``) hands it ``fetch(a, b) -> bytes``,
which returns exactly those bytes or raises its typed error naming the URL (retries and mid-body resume are the
caller's, per part).

- ``PartPool``: the bounded worker threads of this process (``pool_for(size)``; keyed by the process id like the
  S3 client, because threads do not survive fork: a DataLoader worker makes its own). Parts are served in the order
  their streams were opened, so parts read ahead never delay the stream being read.
- ``PartStream``: the parts of a range (``PART`` bytes, or fewer so that a shorter range still spreads over every
  connection, at least ``MIN_PART``), at most the pool's size of them submitted ahead of the
  reader (memory: those parts plus what the reader has not consumed). A part's error is raised when the reader
  reaches it; ``close()`` cancels the parts not started.
- ``ReadAhead`` (``READ_AHEAD``): streams opened ahead of their reader, keyed by ``(url, start, stop)``, within a
  byte budget; ``take`` hands one over (and drops those offered before it: the reader has passed them). One table
  per thread: a table's order is one reader's plan, and streams in threads of one process (the thread run mode)
  must never close each other's ranges by taking or clearing their own.
- ``TransferLimits`` and ``TransferClock``: how slow a server may be before a request is cut off, the one rule
  every ``s3://`` and ``http(s)://`` response body is read under (docs/object-storage.md, "Slow servers"). A socket
  timeout bounds only the wait for the next byte, so a server that sends one byte every few seconds would hold a
  read for hours; the clock times each read of a body (one ``recv`` at most, so it is checked between bytes) and
  cuts the request off when a window of waiting brought less than the minimum rate, or the request has waited
  longer than its deadline in all. Only time spent waiting inside reads counts: a reader that pauses between reads
  (a DataLoader worker blocked on a full queue) is never taken for a slow server.
"""

from __future__ import annotations

import heapq
import io
import itertools
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from shards.errors import CorruptDataError
from shards.units import human_bytes

PART = 8 << 20  # bytes per request of a long range: 0.13 s at 60 MB/s, so 20 ms of latency costs ~13%
MIN_PART = 4 << 20  # a shorter range is cut into parts of at least this (fewer, so requests cost less CPU and latency)
FIRST_PART = 1 << 20  # a whole object of unknown size: the first request, which also says the size
MAX_AHEAD = 256  # ranges opened ahead per thread, at most (far more than the requests a pool keeps in flight)
DEFAULT_CONCURRENCY = 8  # requests in flight per process (S3Options.max_concurrency; http(s) always)
DEFAULT_READ_AHEAD_BYTES = 64 << 20  # bytes of coming reads in flight ahead (S3Options.read_ahead_bytes; http(s))

Fetch = Callable[[int, int], bytes]
# The defaults of ``TransferLimits`` (and so of ``S3Options``): a live link moves far more than 1 KiB in 30 s of
# waiting, and the slowest honest request (one 64 MiB GET of S3, or a whole shard streamed from a server without
# ranges) waits far less than 30 minutes, while a server sending a byte every second is cut off within 30 s.
DEFAULT_MIN_RATE = 1024  # bytes per second of waiting, averaged over a window
DEFAULT_RATE_WINDOW_S = 30.0
DEFAULT_REQUEST_DEADLINE_S = 1800.0


@dataclass(frozen=True)
class TransferLimits:
    """How slow a server may be (see the module docstring): at least ``min_rate`` bytes per second of waiting over
    every ``window_s`` seconds of waiting (0: no minimum), and at most ``deadline_s`` seconds of waiting per
    request. The status line and headers of an ``http(s)`` answer must arrive within ``header_s``."""

    min_rate: int = DEFAULT_MIN_RATE
    window_s: float = DEFAULT_RATE_WINDOW_S
    deadline_s: float = DEFAULT_REQUEST_DEADLINE_S

    @property
    def header_s(self) -> float:
        return min(self.window_s, self.deadline_s)


class TransferClock:
    """The waiting of one request: each read of its body goes through ``read`` (or ``read_up_to``), which raises a
    ``CorruptDataError`` naming ``url`` once the server is slower than ``limits`` allow. Not retried: a server that
    slow on one request is not expected to be faster on the next, and a retry would start the wait over."""

    def __init__(self, limits: TransferLimits, url: str):
        self.limits, self.url = limits, url
        self.waited = 0.0  # seconds inside reads, this request
        self._window_waited = 0.0
        self._window_bytes = 0

    def read(self, read: Callable[[int], bytes], size: int) -> bytes:
        """``read(size)`` (a read of at most one ``recv``: ``read1``), timed."""
        began = time.monotonic()
        data = read(size)
        self.count(len(data), time.monotonic() - began)
        return data

    def read_up_to(self, read: Callable[[int], bytes], size: int) -> bytes:
        """``size`` bytes by ``read`` calls (each timed), fewer only where the body ends."""
        parts, got = [], 0
        while got < size and (data := self.read(read, size - got)):
            parts.append(data)
            got += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def count(self, nbytes: int, seconds: float) -> None:
        self.waited += seconds
        self._window_waited += seconds
        self._window_bytes += nbytes
        limits = self.limits
        if self.waited > limits.deadline_s:
            raise CorruptDataError(f"cut off: the request waited on the server for more than {limits.deadline_s:g} s "
                                   "in all (request_deadline_s, --request-deadline)", path=self.url)
        if self._window_waited >= limits.window_s:
            if self._window_bytes < limits.min_rate * self._window_waited:
                raise CorruptDataError(
                    f"cut off: the server sent {self._window_bytes} bytes in {self._window_waited:.1f} s, slower than "
                    f"the minimum of {human_bytes(limits.min_rate)}/s (min_transfer_rate, --min-transfer-rate)",
                    path=self.url)
            self._window_waited, self._window_bytes = 0.0, 0


class PartPool:
    """``size`` daemon threads taking ``fn(*args)`` calls in priority order (lowest first, then first come)."""

    def __init__(self, size: int):
        self.size = size
        self._heap: list[tuple[int, int, Future, Callable, tuple]] = []
        self._cond = threading.Condition()
        self._order = itertools.count()
        self._priorities = itertools.count()
        self._threads: list[threading.Thread] = []

    def next_priority(self) -> int:
        with self._cond:
            return next(self._priorities)

    def submit(self, priority: int, fn: Callable, *args: Any) -> Future:
        future: Future = Future()
        with self._cond:
            heapq.heappush(self._heap, (priority, next(self._order), future, fn, args))
            if len(self._threads) < self.size:
                thread = threading.Thread(target=self._work, name=f"shardcache-part-{len(self._threads)}",
                                          daemon=True)
                self._threads.append(thread)
                thread.start()
            self._cond.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                _, _, future, fn, args = heapq.heappop(self._heap)
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started: its stream was closed
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 (handed to the reader, raised when it reaches this part)
                future.set_exception(exc)


_pools: dict[tuple[int, int], PartPool] = {}
_pools_lock = threading.Lock()


def pool_for(size: int) -> PartPool:
    """This process's pool of ``size`` threads (a forked child never uses its parent's: its threads are gone)."""
    key = (os.getpid(), size)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            for stale in [k for k in _pools if k[0] != key[0]]:
                del _pools[stale]
            pool = _pools[key] = PartPool(size)
        return pool


def part_length(length: int, connections: int) -> int:
    """The bytes per request of a ``length``-byte range read over ``connections``: a range of a few parts' length is
    spread over every connection (parts of at least ``MIN_PART``), a long one cut into ``PART``s. ``PART`` and
    ``MIN_PART`` are looked up at each use, so a value set here (a test's) takes effect; the forecast
    (``shards.forecast.requests``) counts requests by this rule."""
    return min(PART, max(MIN_PART, -(-length // connections)))


class PartStream(io.RawIOBase):
    """Bytes ``[start, stop)`` of ``url`` as parts fetched by ``fetch`` on ``pool``, read in order. ``head``: bytes
    already fetched just before ``start`` (the first request of a whole object), read first."""

    def __init__(self, fetch: Fetch, url: str, start: int, stop: int, pool: PartPool, *, part: int | None = None,
                 head: bytes = b""):
        super().__init__()
        self.url, self.start, self.stop = url, start, stop
        self._fetch, self._pool = fetch, pool
        part = part or part_length(stop - start, pool.size)
        self._bounds = deque((a, min(a + part, stop)) for a in range(start, stop, part))
        self._pending: deque[tuple[int, int, Future]] = deque()
        self._buffer = memoryview(head)
        self._priority = pool.next_priority()
        self._submit()

    def readable(self) -> bool:
        return True

    def _submit(self) -> None:
        while self._bounds and len(self._pending) < self._pool.size:
            a, b = self._bounds.popleft()
            self._pending.append((a, b, self._pool.submit(self._priority, self._fetch, a, b)))

    def _next_part(self) -> bool:
        if not self._pending:
            return False
        a, b, future = self._pending.popleft()
        data = future.result()  # the part's own error (typed, naming the URL) surfaces here
        self._submit()
        if len(data) != b - a:
            raise CorruptDataError(f"short read at byte {a} ({len(data)} of {b - a} bytes)", path=self.url)
        self._buffer = memoryview(data)
        return True

    def read(self, size: int | None = -1) -> bytes:
        if self.closed:
            raise ValueError("read of a closed stream")
        if size is None or size < 0:
            chunks = [bytes(self._buffer)]
            while self._next_part():
                chunks.append(bytes(self._buffer))
            self._buffer = memoryview(b"")
            return b"".join(chunks)
        while not len(self._buffer):
            if size == 0 or not self._next_part():
                return b""
        data = bytes(self._buffer[:size])
        self._buffer = self._buffer[size:]
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(memoryview(buffer).cast("B")))
        memoryview(buffer).cast("B")[:len(data)] = data
        return len(data)

    def close(self) -> None:
        """Cancel the parts not started (those running finish; their bytes are dropped)."""
        for _, _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._bounds.clear()
        self._buffer = memoryview(b"")
        super().close()


class ReadAhead(threading.local):
    """Streams opened ahead of their reader, oldest first: at most ``MAX_AHEAD`` of them, holding at most ``budget``
    bytes of ranges (one range always fits when the table is empty: a stream itself holds at most its pool's size
    of parts). Entries never taken are closed when the reader takes a later one, or on ``clear()``.

    A thread-local: each thread that uses the table sees its own entries (``__init__`` runs in each), so one
    thread's ``take`` or ``clear`` never closes another's ranges. Hence no lock: no entry is seen by two threads."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[str, int, int], PartStream] = OrderedDict()
        self._held = 0  # bytes of the ranges in the table
        self._pid = os.getpid()

    def _own(self) -> None:
        if self._pid != os.getpid():  # inherited across fork: the parent's streams are not this process's
            self._entries, self._held, self._pid = OrderedDict(), 0, os.getpid()

    def held_bytes(self) -> int:
        self._own()
        return self._held

    def offer(self, key: tuple[str, int, int], budget: int, open_stream: Callable[[], PartStream]) -> bool:
        """Open ``key``'s stream now unless it is open already; False when the budget has no room for it."""
        _, start, stop = key
        self._own()
        if key in self._entries:
            return True
        if budget <= 0 or len(self._entries) >= MAX_AHEAD or (
                self._entries and self._held + (stop - start) > budget):
            return False
        self._entries[key] = open_stream()
        self._held += stop - start
        return True

    def take(self, key: tuple[str, int, int]) -> PartStream | None:
        """The stream opened ahead for ``key`` (then no longer in the table), or None."""
        self._own()
        if key not in self._entries:
            return None
        while True:
            (url, start, stop), stream = self._entries.popitem(last=False)
            self._held -= stop - start
            if (url, start, stop) == key:
                return stream
            stream.close()  # offered before the one read now: the reader went past it

    def clear(self) -> None:
        self._own()
        for stream in self._entries.values():
            stream.close()
        self._entries.clear()
        self._held = 0


READ_AHEAD = ReadAhead()  # the calling thread's table


def _after_fork_in_child() -> None:
    """A lock a thread of the parent held at the fork would stay held in the child: start with a free one. (The
    forking thread's read-ahead table, kept in the child, is emptied by its first use there.)"""
    global _pools_lock
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_range(fetch: Fetch, url: str, start: int, stop: int, concurrency: int) -> PartStream:
    """Bytes ``[start, stop)`` of ``url`` in parts: the stream ``read_ahead`` opened for them, else a new one."""
    taken = READ_AHEAD.take((url, start, stop))
    return taken if taken is not None else PartStream(fetch, url, start, stop, pool_for(concurrency))


def read_ahead(fetch: Fetch, url: str, start: int, stop: int, concurrency: int, budget: int) -> bool:
    """Start ``[start, stop)`` of ``url`` now for a later ``open_range``; False when ``budget`` has no room."""
    return READ_AHEAD.offer((url, start, stop), budget,
                            lambda: PartStream(fetch, url, start, stop, pool_for(concurrency)))


def drop_read_ahead() -> None:
    """Close every stream this thread opened ahead (its reader starting a new plan); other threads' stay open."""
    READ_AHEAD.clear()
