"""Decoding a stream's samples in a pool of threads, ahead of the one reading them, results in stream order.

Reading a shard (file reads, tar headers, the order) and decoding its images are different work: reads wait on the
disk or the network, decoders (simplejpeg, PIL, torch's uint8 kernels) keep a CPU busy and release the GIL while
they do. Here the thread that iterates a stream reads on while up to ``ahead`` of its samples are being decoded by
the pool, so I/O and CPU overlap with a concurrency of their own (SPDL's separate I/O and CPU stages), and the
results still come out in the stream's order: the plan, the error policy and the stage seconds see one sequence,
whichever thread decoded what. The sample the stream is waiting for is the one published to the watchdog
(``shards.procs.worker_status``): the oldest, not the newest, is the one a stall is blamed on.

Used inside a DataLoader worker process (``WorkerProcesses(n, decoders=m)``: SPDL's multi-threading in
multi-processing, for decoders that hold the GIL or a training step that needs the main process's CPU) and by the
thread run mode (``shards.loader.threads``), whose workers share one pool.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator

AHEAD_PER_THREAD = 2  # samples in flight per decode thread: one decoding, one queued behind it


def one_intraop_thread(keep: int) -> None:
    """A decode thread runs torch's kernels on its own thread: a parallel region per decode would put two teams of
    threads on every core.

    Why ``keep`` (the count the creating thread sees, put back at once): torch's count is per thread only once a
    thread has run torch; one that has not yet (the training thread of a script that builds the loader first) takes
    the count last set anywhere. Setting 1 here made the whole training step run on one core, which changed its
    numbers and broke exact resume. Putting ``keep`` back from here would undo this thread's 1, so a short thread
    of its own does it."""
    import torch

    torch.set_num_threads(1)
    torch.get_num_threads()  # this thread's first ask fixes its count (at 1); asked after the restore, it took keep
    restore = threading.Thread(target=torch.set_num_threads, args=(keep,), name="shardcache-thread-count")
    restore.start()
    restore.join()


def intraop_threads() -> int:
    """The calling thread's torch thread count (its first call fixes it for that thread: see ``one_intraop_thread``)."""
    import torch

    return torch.get_num_threads()


class DecodeAhead:
    """A pool of ``threads`` decode threads; ``results`` decodes one stream through it (several streams may share
    it, each keeping at most ``ahead`` samples in flight)."""

    def __init__(self, threads: int, ahead: int | None = None):
        self.threads = threads
        self.ahead = ahead if ahead is not None else AHEAD_PER_THREAD * threads
        self._pool: ThreadPoolExecutor | None = None
        self._keep = intraop_threads()  # the creating thread's count (the pool starts later, from a loader thread)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shardcache-decode",
                                            initializer=one_intraop_thread, initargs=(self._keep,))
        return self._pool

    def results(self, jobs: Iterator[tuple], decode: Callable[[Any, int, int], Any], watch: Any = None,
                own: bool = False) -> Iterator[tuple]:
        """``(where, sample, row, decode(sample, seed, row))`` per job ``(where, sample, row, seed, passed)`` in
        job order (``None`` for a job ``passed`` over); ``own``: shut the pool down when the stream ends."""
        pool = self._executor()
        pending: deque[tuple[str, Any, int, Future | None]] = deque()
        try:
            for where, sample, row, seed, passed in jobs:
                pending.append((where, sample, row, None if passed else pool.submit(decode, sample, seed, row)))
                if len(pending) >= self.ahead:
                    yield self._take(pending, watch)
            while pending:
                yield self._take(pending, watch)
        finally:  # ended, raised or dropped: nothing of this stream keeps decoding
            for *_, future in pending:
                if future is not None:
                    future.cancel()
            if own:
                self.close()

    @staticmethod
    def _take(pending: deque, watch: Any) -> tuple:
        where, sample, row, future = pending.popleft()
        if future is None:
            return where, sample, row, None
        if watch is not None and not future.done():
            watch.working(row, sample.key)
        return where, sample, row, future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
