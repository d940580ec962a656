"""Torch's private DataLoader names, in one place: every use of them goes through this module.

Stall recovery (``shards.loader.watchdog``) watches torch's multi-process iterator from the inside, and the worker
process run shuts it down early (``shards.loader.worker_processes``); nothing public offers either. Torch may rename
any of these in a release, so they are spelled once, here, and ``tests/shards/test_torch_private.py`` pins each one
against the installed torch (it exists and behaves as used): an upgrade that moves one fails that test by name, not
a stall recovery in the middle of someone's run.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.data._utils import signal_handling
from torch.utils.data._utils.collate import collate, default_collate, default_collate_fn_map
from torch.utils.data._utils.pin_memory import pin_memory as pin_nested

__all__ = [
    "awaited_index", "awaited_workers", "collate", "default_collate", "default_collate_fn_map",
    "forget_persistent_iterator", "pin_nested", "pin_thread_dead", "release_sigchld", "replace_get_data",
    "shutdown_workers", "try_get_data", "worker_processes", "workers_expected", "workers_stopped",
]


def release_sigchld(iterator: Any) -> None:
    """Take ``iterator``'s worker pids out of torch's ``SIGCHLD`` handler, which would raise wherever the main thread
    happens to be when a worker dies; the caller watches the workers itself."""
    iterator = getattr(iterator, "torch_iterator", iterator)  # torch keys the pids by its own iterator's id
    if getattr(iterator, "_worker_pids_set", False):
        signal_handling._remove_worker_pids(id(iterator))
        iterator._worker_pids_set = False


def replace_get_data(iterator: Any, get_data: Callable[[], Any]) -> None:
    """Make ``get_data()`` what ``iterator`` calls to wait for its next batch (torch's ``_get_data``)."""
    iterator._get_data = get_data


def awaited_index(iterator: Any) -> int:
    """The index of the batch ``iterator`` waits for next."""
    return iterator._rcvd_idx


def workers_expected(iterator: Any) -> list[bool]:
    """Per worker, whether ``iterator`` still expects work from it (torch marks one it finds dead as done)."""
    return list(iterator._workers_status)


def try_get_data(iterator: Any, timeout_s: float) -> tuple[bool, Any]:
    """``(got, data)``: one wait of at most ``timeout_s`` for the next item from the workers' result queue."""
    return iterator._try_get_data(timeout_s)


def pin_thread_dead(iterator: Any) -> bool:
    """Whether ``iterator`` pins memory and its pinning thread has ended."""
    return bool(iterator._pin_memory) and not iterator._pin_memory_thread.is_alive()


def awaited_workers(iterator: Any) -> list[int]:
    """The worker the awaited batch was sent to, as a list (empty: none known)."""
    info = iterator._task_info.get(iterator._rcvd_idx)
    return [info[0]] if info else []


def worker_processes(iterator: Any) -> list[Any]:
    """``iterator``'s worker processes (``multiprocessing.Process``), by worker id."""
    return list(iterator._workers)


def shutdown_workers(iterator: Any) -> None:
    """Stop ``iterator``'s workers and release its queues now (nothing to do for a single-process iterator)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def workers_stopped(iterator: Any) -> bool:
    """Whether ``iterator``'s worker processes have been shut down (an exhausted or closed non-persistent one)."""
    return bool(getattr(iterator, "_shutdown", True))


def forget_persistent_iterator(dataloader: Any) -> None:
    """Make ``dataloader`` start fresh workers on its next ``iter``, rather than reuse a persistent iterator."""
    dataloader._iterator = None
