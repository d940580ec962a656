"""What a process tree holds in memory, measured the one way the run record and the memory bench share.

A loader's memory in flight lives in three places: its worker processes, the batches waiting in ``/dev/shm`` for
the loop to map them (mapped by no process yet, so no process's set size counts them), and, in threads or in
process, the training process itself. The measure is the proportional set size (PSS: a page shared by n processes
counts 1/n in each, so forked workers' copy-on-write pages are counted once, where RSS would count them per worker)
of this process and every descendant, plus what ``/dev/shm`` holds. ``/dev/shm`` is the mount's whole use, other
jobs' included, which is why readers take the difference to a sample at the start (``train.run.meter``,
``scripts/bench/memory.py``). A batch the loop has mapped counts both in ``/dev/shm`` and in the PSS of the
process that maps it: an upper bound by at most the batches the loop holds.

Reading ``smaps_rollup`` walks a process's page tables (milliseconds for a large training process), so callers
sample it every few seconds, never per batch or per sample.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SHM = "/dev/shm"


@dataclass(frozen=True)
class TreeMemory:
    """One reading: the PSS of the process itself (``own``: in threads or in process, the loader's flight is here,
    beside the model's), of its descendants (worker processes), and what ``/dev/shm`` holds, in bytes."""

    own: int
    descendants: int
    shm: int

    @property
    def total(self) -> int:
        return self.own + self.descendants + self.shm


def _pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def tree_memory(pid: int | None = None) -> TreeMemory | None:
    """``pid`` (default: this process), its descendants and ``/dev/shm``; None where the kernel gives no PSS (no
    ``/proc/PID/smaps_rollup``: not Linux, or before 4.14). A descendant that ends meanwhile counts 0."""
    root = os.getpid() if pid is None else pid
    try:
        own, stack = _pss_kb(root), _children(root)
    except (OSError, ValueError):
        return None
    descendants = 0
    while stack:
        current = stack.pop()
        try:
            descendants += _pss_kb(current)
            stack += _children(current)
        except (OSError, ValueError):
            continue
    return TreeMemory(own * 1024, descendants * 1024, shm_used_bytes())


def tree_pss_bytes(pid: int | None = None) -> int | None:
    """The PSS of ``pid`` and its descendants in bytes (no ``/dev/shm``); None where the kernel does not say."""
    reading = tree_memory(pid)
    return None if reading is None else reading.own + reading.descendants


def shm_used_bytes() -> int:
    """The bytes ``/dev/shm`` holds (0 where there is none): worker processes' batches wait there unmapped."""
    try:
        stat = os.statvfs(SHM)
    except OSError:
        return 0
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


def tree_memory_bytes(pid: int | None = None) -> int | None:
    """The tree's PSS plus what ``/dev/shm`` holds; None where PSS cannot be read."""
    reading = tree_memory(pid)
    return None if reading is None else reading.total
