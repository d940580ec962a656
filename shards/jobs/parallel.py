"""Running independent jobs (one per shard) in worker processes, results handed back in job order.

The pool pattern pack-shards uses for its pack workers (``preprocess.pack.packer.run_jobs``): a
``ProcessPoolExecutor`` on ``fork`` where the platform has it, else ``spawn`` (so ``fn`` and every job must be
picklable module-level objects), the first worker exception cancels what has not started and is raised as it is.
Here the results come back in the order of ``jobs`` whatever order workers finish in, so a report built from them
is the one a serial run builds; ``on_done`` is told of each finished job as it finishes (a progress bar).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Callable, Iterator, Sequence, TypeVar

J = TypeVar("J")
R = TypeVar("R")
MAX_DEFAULT_WORKERS = 8


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def start_context() -> multiprocessing.context.BaseContext:
    """How every process this project starts is started (pack pools, DataLoader workers) and what its shared blocks
    are made for: ``fork`` where the platform has it, named, never the interpreter's default.

    Why named: Python 3.14 makes ``forkserver`` the default on Linux. Workers started that way would need the
    shared blocks pickled to them, and blocks made for it hold named semaphores that start multiprocessing's resource
    tracker, which a whole-job SIGUSR1 (Slurm's warning before preemption) kills, ending a run that saved its place
    with the tracker's traceback. One context for all keeps 3.14 running as 3.10-3.13 do."""
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def ordered_map(fn: Callable[[J], R], jobs: Sequence[J], workers: int,
                on_done: Callable[[R], None] = lambda result: None) -> Iterator[R]:
    """``fn(job)`` for every job, yielded in job order; ``workers == 1`` (or one job) runs them here, one after
    another. Results are yielded as soon as every earlier one is in, so at most the out-of-order ones are held."""
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            result = fn(job)
            on_done(result)
            yield result
        return
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=start_context()) as pool:
        order: dict[Future, int] = {pool.submit(fn, job): i for i, job in enumerate(jobs)}
        pending, ready, next_index = set(order), {}, 0
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    ready[order[future]] = future.result()  # a worker's exception is raised here
                    on_done(ready[order[future]])
                while next_index in ready:
                    yield ready.pop(next_index)
                    next_index += 1
        finally:
            for future in pending:
                future.cancel()
