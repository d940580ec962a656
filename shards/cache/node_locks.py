"""The file helpers every part of the node cache shares (``shards.cache.node``, ``node_index``, ``plan_view``),
kept below them so none imports another for them: ``flock`` on lock files, removal, and reading the folder's own
small JSON files, all under one rule for what someone else may have put there.

Every coordination of the node cache is a ``flock`` on a file under ``<dir>/v1``: the kernel drops it when its
holder dies, so a killed process never wedges the node.

A cache folder may be shared by other jobs and other users (docs/caching.md, "A shared folder"), so every name under
it may have been planted: a link out of the folder, a FIFO, a directory, a file its owner keeps unreadable. None of
them is followed, opened in a way that blocks, or allowed to crash a reader:

- a lock or lease file is opened read-only (``flock`` needs no more, so another user's lock files serve), never
  through a final symlink (``O_NOFOLLOW``), non-blocking (a FIFO cannot hang the open) and used only if it is a
  regular file. One that cannot be used is reported as not taken (``open_locked`` returns None), exactly like a
  lock someone else holds, so each caller's answer to "held" is its answer to "planted" too: read the shard from
  the source, keep the entry, skip the leftover;
- a file that cannot be removed (another user's, in a sticky folder) is left where it is (``unlink`` says so);
- a plan, stamp or reservation is read through the one door (``shards.door.bounded_read``: regular file, size cap, depth
  cap) after an ``lstat`` that refuses a symlink (``read_cache_json``), then checked for shape by its reader.

Each such file is reported once per process (``warn_once``): an eviction scan runs on every fetch, and a planted
file must not turn into a warning per scan.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shards.door.bounded_read import not_regular_reason, read_json_file

log = logging.getLogger("shardcache.cache")

SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}\Z")
_warned: set[str] = set()  # the files this process has warned about (a forked worker inherits the parent's)


def warn_once(path: str | os.PathLike, message: str) -> None:
    """Log ``<path>: <message>`` as a warning the first time this process meets ``path``, as debug after."""
    where = str(path)
    level = logging.DEBUG if where in _warned else logging.WARNING
    _warned.add(where)
    log.log(level, "%s: %s", where, message)


def open_locked(path: Path, flags: int) -> int | None:
    """An open descriptor holding ``flock(flags)`` on ``path`` (created if missing); None when ``LOCK_NB`` was given
    and it is held, or when the file is not one a lock may be taken on (a link, a FIFO, a directory, unreadable:
    warned once)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        warn_once(path, f"not used as a node-cache lock ({_reason(exc)}); reading around it")
        return None
    try:
        reason = not_regular_reason(os.fstat(fd).st_mode)
        if reason is not None:
            os.close(fd)
            warn_once(path, f"not used as a node-cache lock ({reason}); reading around it")
            return None
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
    """Hold ``flock(flags)`` for the block; yields whether it was taken (False: held by someone else with
    ``LOCK_NB``, or a file no lock may be taken on, whatever the flags)."""
    fd = open_locked(path, flags)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


def unlink(path: Path) -> bool:
    """Remove ``path``; whether it is gone. One this process may not remove (another user's, in a sticky folder; a
    directory) is left, warned once."""
    try:
        path.unlink()
    except FileNotFoundError:
        return True
    except OSError as exc:
        warn_once(path, f"cannot be removed from the node cache ({_reason(exc)}); left in place")
        return False
    return True


def read_cache_json(path: Path, limit: int) -> Any:
    """The JSON value of one of the cache folder's own small files (a plan, a stamp, a reservation): a regular file
    of at most ``limit`` bytes, not reached through a symlink. ``MissingInputError`` when it is gone, else an
    ``InputError`` naming it; the shape is the caller's to check."""
    return read_json_file(path, limit=limit, follow_symlinks=False)


def _reason(exc: OSError) -> str:
    """``exc`` in words; ``O_NOFOLLOW``'s ``ELOOP`` says "too many levels of symbolic links" of one link."""
    return {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory"}.get(exc.errno or 0, exc.strerror or str(exc))
