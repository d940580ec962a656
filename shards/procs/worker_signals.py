"""What the main process asks of its DataLoader worker processes by signal: their Python stacks (``SIGUSR1``) and
their end (``SIGKILL`` to the process group each leads), for stall and crash recovery (``shards.loader.watchdog``).

A hung worker cannot be asked anything through its queues, so each one, as it starts, registers ``faulthandler``
on ``SIGUSR1`` (which writes from the signal handler: a worker stuck in a loop or a C call answers too) and leads a
process group, so that killing the group also ends whatever a hung decoder started. A stopped worker answers
nothing and is named as stopped; a dead one is named by its exit code or signal.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Callable

from shards.procs import torch_private

DUMP_WAIT_S = 2.0  # how long the live workers get to write their stacks
_OPEN_DUMPS: list = []  # a worker's dump file stays open for its lifetime (faulthandler writes to its descriptor)


class StackDumps:
    """A ``worker_init_fn``: the worker writes all its threads' Python stacks to ``<folder>/worker-<id>.txt`` on
    ``SIGUSR1`` (``faulthandler`` writes from the signal handler, so a worker stuck in a loop or a C call answers
    too); ``then`` (the caller's ``worker_init_fn``) still runs. The file is emptied when a worker starts: the
    workers before it with that id were stopped (an epoch's end or a restart) after their dumps were read.

    The worker also leads a process group, which ``stop_workers`` kills (a decoder's subprocess would otherwise
    outlive every restart); torch's workers ignore the terminal's Ctrl-C anyway, and ``OrphanGuard`` still ends
    one whose main process is gone."""

    def __init__(self, folder: str, then: Callable[[int], Any] | None = None):
        self.folder = folder
        self.then = then

    def __call__(self, worker_id: int) -> None:
        try:
            os.setpgid(0, 0)
        except OSError:  # not permitted (a session leader): its children are then killed with it only by luck
            pass
        handle = open(dump_path(self.folder, worker_id), "w")
        _OPEN_DUMPS.append(handle)
        faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)
        if self.then is not None:
            self.then(worker_id)


def dump_path(folder: str, worker: int) -> str:
    return os.path.join(folder, f"worker-{worker}.txt")


def collect_stacks(workers: list, folder: str) -> dict[int, str]:
    """Each live worker's Python stacks, asked for by ``SIGUSR1`` and read from its file in ``folder``
    (``StackDumps``); a stopped one cannot answer: it is named as stopped."""
    asked, stacks = {}, {}
    for index, process in enumerate(workers):
        if not process.is_alive():
            continue
        if stopped(process.pid):
            stacks[index] = "(stopped: a stopped process cannot write its stacks)"
            continue
        try:
            os.kill(process.pid, signal.SIGUSR1)
            asked[index] = Path(dump_path(folder, index))
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + DUMP_WAIT_S
    while time.monotonic() < deadline and not all(p.exists() and p.stat().st_size for p in asked.values()):
        time.sleep(0.02)
    time.sleep(0.05)  # a dump being written when we looked: let it finish
    for index, path in asked.items():
        try:
            stacks[index] = path.read_text(errors="replace")
        except FileNotFoundError:
            continue
    return stacks


def stop_workers(iterator: Any) -> None:
    """Kill every worker with its process group (SIGKILL reaches a stopped or hung one too, and whatever a decoder
    started; a dead worker's group may still hold its children) and let the iterator release its queues."""
    processes = torch_private.worker_processes(iterator)
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the group each worker leads (``StackDumps``)
        except (ProcessLookupError, PermissionError):
            pass
        if process.is_alive():  # one that leads no group (or has not been reaped yet: a zombie ignores this)
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes:
        process.join(timeout=5)
    torch_private.shutdown_workers(iterator)


def exit_reason(exitcode: int | None) -> str:
    """``"exit <code>"`` or ``"signal <NAME>"`` (a process ended by a signal has a negative exit code)."""
    if exitcode is None:
        return "stall"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit {exitcode}"


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (``SIGSTOP``): it could not answer a stack dump request."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def stuck_frame(stacks: str) -> str | None:
    """The innermost frame of a worker's main thread in a ``faulthandler`` dump (the thread running torch's
    worker loop): ``function (file:line)``."""
    for block in re.split(r"\n\s*\n|(?=^(?:Current thread|Thread) 0x)", stacks, flags=re.M):
        if "_worker_loop" in block:
            match = _FRAME.search(block)
            if match:
                return f"{match.group(3)} ({os.path.basename(match.group(1))}:{match.group(2)})"
    return None
