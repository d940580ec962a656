"""Writer locks on an output folder, so two jobs never write one dataset or feature folder at once.

Why ``flock``: the kernel releases the lock when the process holding it dies (crash, ``kill -9``, node reboot for a
local disk), so a killed run never leaves a stale lock that a human must delete, and the lock files themselves
stay in place (deleting a lock file while someone waits on it would let two holders in). It is the lock the cron
script takes with flock(1). Caveats: it works across hosts only where the file system forwards ``flock`` to a lock
server: NFSv4 (and NFSv3 with ``lockd``; Linux emulates flock with byte-range locks there) and Lustre mounted with
``-o flock``. Lustre's ``localflock`` locks only on one node, and a client that loses its NFS lease may lose its lock
without noticing. Where the file system refuses locks (``ENOLCK``/``ENOSYS``/``EOPNOTSUPP``) we log one warning and
go on without it: temp names are unique per host and process, so nothing is corrupted, but concurrent runs are no
longer refused.

``claim_output`` is the protocol every writing stage follows, in ``OUT/<state dir>/``:

- ``lock.setup`` (exclusive, waited for briefly) around checking the folder and writing the plan or config, so
  two runs never both decide the folder is theirs;
- ``lock`` for the whole run: shared by the tasks of one job (a Slurm array packs one folder by design), exclusive
  for ``--append`` and ``--merge``, and upgraded to exclusive only while ``--overwrite`` removes old output;
- ``lock.task-<i>-of-<n>`` (exclusive) so a second run of the same task exits at once;
- ``lock.merge`` (exclusive, waited for) around writing the final manifest, which the last task to finish does.

A lock that another process holds is an ``OutputLockedError`` (an ``InputError``: exit 2, one line naming the folder
and who holds it: host, pid, start time and command, read from the lock file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import Callable, Iterator

from shards.atomic import owned_folder
from shards.errors import InputError

log = logging.getLogger("shardcache.lock")

LOCK_NAME = "lock"
SETUP_WAIT_S = 300.0  # setting up a folder takes seconds; waiting longer means a hung holder
MERGE_WAIT_S = 600.0
_POLL_S = 0.05
_UNSUPPORTED = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP)
_warned: set[str] = set()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a stale lock stamp's owner, a worker's loader). ``pid <= 0`` is
    not a process (``kill`` would address a process group); one owned by someone else (``EPERM``) counts as alive,
    so a reused pid never makes us remove a live process's files or stop a worker."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLockedError(InputError):
    """Another process is writing the output folder (exit code 2)."""


class FolderLock:
    """One held ``flock`` on ``path``: an open file descriptor, released by ``release`` or by process death."""

    def __init__(self, folder: Path, path: Path, fd: int | None, shared: bool, what: str):
        self.folder, self.path, self.fd, self.shared, self.what = folder, path, fd, shared, what

    def exclusive(self) -> None:
        """Upgrade to exclusive without waiting; ``OutputLockedError`` if anyone else holds it."""
        if self.fd is not None and self.shared:
            _flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.folder, self.path, self.what)
            self.shared = False
            _record_holder(self.fd, self.what)

    def share(self) -> None:
        """Back to shared (only ever called while holding ``lock.setup``, so no exclusive waiter slips in)."""
        if self.fd is not None and not self.shared:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            self.shared = True

    def release(self) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if not self.shared:
                os.ftruncate(self.fd, 0)  # the holder line describes a live holder only
        os.close(self.fd)  # closing releases the flock
        self.fd = None


def _holder_line(what: str) -> str:
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return f"host {socket.gethostname()}, pid {os.getpid()}, since {since}, {what or 'a shardcache writer'}"


def _record_holder(fd: int, what: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (_holder_line(what) + "\n").encode("utf-8"), 0)


def _read_holder(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read(500).strip().splitlines()
    except OSError:
        return ""
    return text[0] if text else ""


def _flock(fd: int, flags: int, folder: Path, path: Path, what: str) -> None:
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        holder = _read_holder(path) or "held shared by the running task(s) of another job"
        raise OutputLockedError(f"another process is writing here ({holder}; lock {path.name}); wait for it to "
                                f"finish or choose another --out", path=str(folder)) from None


def _open_lock_file(folder: Path, name: str) -> int:
    path = owned_folder(folder, name.rpartition("/")[0]) / name.rpartition("/")[2]  # a state folder, never a link
    # O_NOFOLLOW: a symlink planted in the output folder must not make us create or truncate a file elsewhere.
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)


def acquire(folder: str | os.PathLike, name: str = LOCK_NAME, *, shared: bool = False, wait_s: float = 0.0,
            what: str = "") -> FolderLock:
    """Take the lock ``folder/name``; wait up to ``wait_s`` seconds for it (0: do not wait)."""
    folder = Path(folder)
    path = folder / name
    fd = _open_lock_file(folder, name)
    flags = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    deadline = time.monotonic() + wait_s
    try:
        while True:
            try:
                _flock(fd, flags, folder, path, what)
                break
            except OutputLockedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(_POLL_S)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _UNSUPPORTED:
            raise
        if str(folder) not in _warned:
            _warned.add(str(folder))
            log.warning("%s: the file system does not support flock (%s); writing without a lock, so a "
                        "concurrent run is not refused", folder, exc.strerror or exc)
        return FolderLock(folder, path, None, shared, what)
    except BaseException:
        os.close(fd)
        raise
    if not shared:
        _record_holder(fd, what)
    return FolderLock(folder, path, fd, shared, what)


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, name: str = LOCK_NAME, *, shared: bool = False, wait_s: float = 0.0,
                what: str = "") -> Iterator[FolderLock]:
    """Hold the lock ``folder/name`` for the ``with`` block; ``OutputLockedError`` if it is taken (see module)."""
    lock = acquire(folder, name, shared=shared, wait_s=wait_s, what=what)
    try:
        yield lock
    finally:
        lock.release()


@contextlib.contextmanager
def claim_output(folder: str | os.PathLike, state_dir: str, *, what: str, task: tuple[int, int] | None = None,
                 exclusive: bool = False, prepare: Callable[[FolderLock], None] | None = None) -> Iterator[None]:
    """Hold the writer locks of one run on ``folder`` (see the module docstring) for the ``with`` block.

    ``prepare(folder_lock)`` runs under ``lock.setup`` after the run's own locks are held: it checks the folder and
    writes the plan; before deleting old output it calls ``folder_lock.exclusive()``, which refuses while another
    run is at work there. ``task=(i, n)``: this is task i of n of one job (n=1 for a plain run).
    """
    folder = Path(folder)
    with contextlib.ExitStack() as held:
        with output_lock(folder, f"{state_dir}/{LOCK_NAME}.setup", wait_s=SETUP_WAIT_S, what=what):
            folder_lock = held.enter_context(output_lock(folder, f"{state_dir}/{LOCK_NAME}", shared=not exclusive,
                                                         what=what))
            if task is not None:
                index, count = task
                held.enter_context(output_lock(folder, f"{state_dir}/{LOCK_NAME}.task-{index}-of-{count}",
                                               what=f"{what} task {index} of {count}"))
            if prepare is not None:
                prepare(folder_lock)
            if not exclusive:
                folder_lock.share()
        yield


def merge_lock(folder: str | os.PathLike, state_dir: str, *, what: str) -> contextlib.AbstractContextManager:
    """The short lock around writing the final manifest (the last tasks of a job may finish together)."""
    return output_lock(folder, f"{state_dir}/{LOCK_NAME}.merge", wait_s=MERGE_WAIT_S, what=what)


def is_lock_file(name: str) -> bool:
    """Whether ``name`` (in a state dir) is a lock file, which must outlive ``--overwrite``."""
    return name == LOCK_NAME or name.startswith(LOCK_NAME + ".")
