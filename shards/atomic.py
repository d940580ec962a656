"""Atomic file output: nothing partial ever appears under a final name.

Every artifact is written to a temp file beside it, flushed and fsynced, then renamed; the folder is fsynced so the
rename survives a crash. Temp names are unique per host, process and call (``<name>.<host>.<pid>.<token>.tmp``),
so two writers (two Slurm tasks on different nodes finishing together, or a second run started by mistake) never
share a temp file. A killed job leaves at most ``*.tmp`` files; ``tmp_target`` maps such a name back to the file it
was meant to become, so the next run of the job that owns that file can remove it (``remove_stale_tmp``).

A full disk (``ENOSPC``, or ``EDQUOT`` for a quota) while writing is a ``DiskFullError``: one line naming the folder
and the space left there, exit code 1, the temp file removed. Every writer that goes through ``atomic_output``
(shards, feature files, part manifests, checkpoints, manifests) gets it; ``on_disk_full`` gives it to a write that
does not (an appended line) and to a whole command, for writes below it that raise a bare ``OSError``. A rerun after
making room does only what is not finished, as after a kill.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import stat
from pathlib import Path
from typing import Any, Collection, Iterator

from shards.door.bounded_read import open_regular_file
from shards.errors import CorruptDataError, InputError, ShardcacheError
from shards.units import human_bytes

TMP_SUFFIX = ".tmp"
# ``<final>.<host>.<pid>.<token>.tmp``: host is reduced to [A-Za-z0-9-] so the pattern below can parse it.
_UNIQUE_TMP = re.compile(r"^(?P<final>.+)\.[A-Za-z0-9-]{1,32}\.\d+\.[0-9a-f]{8}" + re.escape(TMP_SUFFIX) + r"\Z")
_HOST_CHARS = re.compile(r"[^A-Za-z0-9-]+")
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
AGAIN = "make room or write elsewhere, then run again: what is finished is kept"


class DiskFullError(ShardcacheError, OSError):
    """The disk (or quota) of an output folder filled up while shardcache wrote to it (exit code 1); ``errno`` is
    the cause's (``ENOSPC`` or ``EDQUOT``), for callers that test it."""

    def __init__(self, message: str, *, path: str | None = None, cause_errno: int = errno.ENOSPC):
        super().__init__(message, path=path)
        self.errno = cause_errno


def free_space(folder: str | os.PathLike) -> str:
    """``"1.2 MiB free of 2.0 GiB"`` for the file system holding ``folder`` (or its nearest existing parent)."""
    place = Path(folder)
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        usage = shutil.disk_usage(place)
    except OSError:
        return "free space unknown"
    return f"{human_bytes(usage.free)} free of {human_bytes(usage.total)}"


@contextlib.contextmanager
def on_disk_full(folder: str | os.PathLike, writing: str | None = None) -> Iterator[None]:
    """Turn a full disk or quota met inside into one ``DiskFullError`` naming ``folder`` (and the file being
    written) with the space left there, and a folder that refuses writes (permissions, a read-only or immutable
    file system) into one ``InputError`` naming it; every other error passes unchanged."""
    try:
        yield
    except Exception as exc:
        cause = None if isinstance(exc, ShardcacheError) else disk_full_cause(exc)
        if cause is None:
            if isinstance(exc, OSError) and exc.errno in NOT_WRITABLE and _inside(exc.filename, folder):
                raise InputError(f"cannot write here{f' ({writing})' if writing else ''}: {exc.strerror or exc}",
                                 path=str(folder)) from None
            raise
        what = "disk quota exceeded" if cause == errno.EDQUOT else "no space left on device"
        raise DiskFullError(f"{what}{f' writing {writing}' if writing else ''} ({free_space(folder)}); {AGAIN}",
                            path=str(folder), cause_errno=cause) from None


NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _inside(filename: object, folder: str | os.PathLike) -> bool:
    """Whether an error's file is in ``folder``: a permission refused on a file read elsewhere (a source) is not
    this folder refusing writes, and is not reported as if it were."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    path, root = os.path.abspath(os.fsdecode(filename)), os.path.abspath(folder)
    return os.path.commonpath([path, root]) == root


def disk_full_cause(exc: BaseException) -> int | None:
    """``ENOSPC`` or ``EDQUOT`` when ``exc``, or an exception it was raised while handling, is a full disk's
    ``OSError``: a writer that fails again while closing replaces the first error (``torch.save`` raises its own
    ``RuntimeError`` when its archive cannot be finished after the write failed)."""
    for _ in range(8):  # a chain is short; a loop in it must not hang
        if exc is None:
            return None
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def check_room(folder: str | os.PathLike, nbytes: int, writing: str) -> None:
    """A ``DiskFullError`` before writing about ``nbytes`` (plus a tenth and 64 KiB for the format's own
    structures) into ``folder`` when its disk has less free: for a writer that cannot fail cleanly midway. HDF5
    (libhdf5 1.14 under h5py 3) crashes the process with a segmentation fault when it closes a file whose writes
    met a full disk, so the HDF5 writers ask first. A check, not a reservation: a disk another process fills in
    between still fails the write itself."""
    needed = nbytes + nbytes // 10 + (64 << 10)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < needed:
        raise DiskFullError(f"no space left on device for {writing} (about {human_bytes(needed)} needed, "
                            f"{free_space(folder)}); {AGAIN}", path=str(folder))


def check_local_output(out: str | os.PathLike, option: str = "--out") -> None:
    """Refuse an output location that is a URL (``s3://``, ``http://``...) or a ``pipe:`` command.

    Writers write local (or mounted) folders only; without this check ``s3://bucket/x`` silently became a local
    folder named ``s3:``. Call it on the string as given: ``Path`` collapses ``//`` and hides the scheme.
    """
    text = os.fspath(out)
    if _URL.match(text) or text.startswith("pipe:"):
        scheme = text.split(":", 1)[0] + ":"
        raise InputError(f"{option} {text!r}: writing to {scheme} locations is not supported (yet); write to a local "
                         "or mounted folder, then copy the result there")


def make_output_folder(folder: str | os.PathLike) -> Path:
    """``folder`` and its parents, made where missing; one that cannot be (a file in the way, no permission, a
    read-only or virtual file system) is ``InputError`` naming it, exit 2, never an ``OSError`` traceback."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError("is a file, not a folder", path=str(folder)) from None
    except OSError as exc:
        raise InputError(f"cannot make the folder ({exc.strerror or exc})", path=str(folder)) from None
    return folder


def owned_folder(out: str | os.PathLike, rel: str) -> Path:
    """``out / rel`` (a ``/``-separated folder name), each level made here or found as a real folder, never a
    symlink; ``rel`` empty: ``out`` itself (which the user named, and may be a link).

    Why: an output folder may sit where others can write (a shared project folder), and the folders a run writes
    below it (its state folder, ``columns``, an index's parts) have fixed or source-given names. A planted
    ``OUT/.pack`` symlink must not carry plans, locks or part files outside ``--out``; one that exists is used only
    if ``lstat`` says it is a real folder, else ``InputError`` naming it."""
    folder = Path(out)
    make_output_folder(folder)
    for part in (p for p in rel.split("/") if p):
        if part in (".", ".."):
            raise InputError(f"names the folder {rel!r}, which leaves the output folder", path=str(out))
        folder = folder / part
        try:
            os.mkdir(folder)
        except FileExistsError:
            pass
        except OSError as exc:
            raise InputError(f"cannot make the folder ({exc.strerror or exc})", path=str(folder)) from None
        mode = os.lstat(folder).st_mode
        if not stat.S_ISDIR(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a folder"
            raise InputError(f"is {what}; shardcache writes only real folders inside its output folder (remove it "
                             "and run again)", path=str(folder))
    return folder


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def host_tag() -> str:
    return _HOST_CHARS.sub("-", socket.gethostname()).strip("-")[:32] or "host"


def unique_tmp_path(final: str | os.PathLike) -> Path:
    """A temp name beside ``final`` that no other process, on this host or another, will pick."""
    final = Path(final)
    return final.with_name(f"{final.name}.{host_tag()}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")


def tmp_target(name: str) -> str | None:
    """The final file name a temp file ``name`` was written for, or None if ``name`` is not one of our temp names
    (a user's own ``x.tar.tmp`` is not ours to remove)."""
    match = _UNIQUE_TMP.match(name)
    return match.group("final") if match else None


def remove_stale_tmp(folder: str | os.PathLike, finals: Collection[str]) -> int:
    """Remove the temp files in ``folder`` of the final names ``finals`` (left by a killed run); returns the count.

    Only the process that owns those final names (under its output lock) may call this: it would also remove a
    temp file another live writer of the same name is still filling.
    """
    folder = Path(folder)
    if not finals or not folder.is_dir():
        return 0
    removed = 0
    for entry in os.scandir(folder):
        if entry.name.endswith(TMP_SUFFIX) and tmp_target(entry.name) in finals:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
    return removed


@contextlib.contextmanager
def atomic_output(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a unique temp path to write; on success fsync it and rename it to ``final``; on error remove it (a
    full disk is a ``DiskFullError`` naming ``final``'s folder)."""
    final = Path(final)
    tmp = unique_tmp_path(final)
    try:
        with on_disk_full(final.parent, final.name):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            yield tmp
            with open(tmp, "rb+") as handle:
                os.fsync(handle.fileno())
            os.replace(tmp, final)
            fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def write_bytes_atomic(final: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` atomically. Safe when several processes write the same file at once: each has its own temp
    file and renames a complete one, so the last rename wins and no reader ever sees a mixture."""
    with atomic_output(final) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)


def json_text(obj: Any) -> str:
    """JSON with sorted keys, two-space indents and every list of numbers on one line, and a trailing newline, so
    equal content gives equal bytes. One number per line made an ImageNet-size ``dataset.json`` (1,000 class counts
    per shard, 1,280 shards) 20 MB instead of 4: five times the bytes every rank reads and parses."""
    folded: list[str] = []
    token = _unused_token(obj)

    def fold(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: fold(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            if value and all(type(item) in (int, float) for item in value):
                folded.append(json.dumps(list(value)))
                return f"{token}{len(folded) - 1}"
            return [fold(item) for item in value]
        return value

    text = json.dumps(fold(obj), indent=2, sort_keys=True, ensure_ascii=False)
    if folded:
        marker = re.escape(json.dumps(token, ensure_ascii=False)[1:-1])
        text = re.sub(f'"{marker}(\\d+)"', lambda m: folded[int(m.group(1))], text)
    return text + "\n"


def _unused_token(obj: Any) -> str:
    """A marker no string in ``obj`` contains (so it never matches a real value), the same for the same ``obj``."""
    strings, stack = [], [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            strings.append(value)
        elif isinstance(value, dict):
            strings.extend(k for k in value if isinstance(k, str))
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    token = "\x00numbers:"
    while any(token in text for text in strings):
        token = "\x00" + token
    return token


def write_json_atomic(final: str | os.PathLike, obj: Any) -> None:
    write_bytes_atomic(final, json_text(obj).encode("utf-8"))


# Several Slurm tasks may write the same manifest at once; unique temp names make every write safe for that.
write_json_shared = write_json_atomic


def write_text_shared(final: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(final, text.encode("utf-8"))


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 22) -> str:
    """The file's sha256, read in blocks; a FIFO or device in its place is refused unopened (the file may be one a
    manifest names)."""
    digest = hashlib.sha256()
    with open_regular_file(path, error=CorruptDataError) as handle:
        while block := handle.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()
