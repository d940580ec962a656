"""The ``flock`` helpers and key pattern every part of the node cache shares (``shards.cache.node``,
``node_index``, ``plan_view``), kept below them so none imports another for them.

Every coordination of the node cache is a ``flock`` on a file under ``<dir>/v1``: the kernel drops it when its
holder dies, so a killed process never wedges the node.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path

SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")


def open_locked(path: Path, flags: int) -> int | None:
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
def locked(path: Path, flags: int = fcntl.LOCK_EX) -> Iterator[bool]:
    """Hold ``flock(flags)`` for the block; yields whether it was taken (False only with ``LOCK_NB``)."""
    fd = open_locked(path, flags)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
