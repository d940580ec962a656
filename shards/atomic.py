"""Atomic file output: nothing partial ever appears under a final name.

Every artifact is written to ``<name>.tmp``, flushed and fsynced, then renamed; the folder is fsynced so the
rename survives a crash. A killed job leaves at most ``*.tmp`` files, which a rerun overwrites.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

TMP_SUFFIX = ".tmp"


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


def tmp_path_for(final: str | os.PathLike) -> Path:
    final = Path(final)
    return final.with_name(final.name + TMP_SUFFIX)


@contextlib.contextmanager
def atomic_output(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path to write; on success fsync it and rename it to ``final``; on error remove it."""
    final = Path(final)
    tmp = tmp_path_for(final)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
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
    with atomic_output(final) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(final: str | os.PathLike, obj: Any) -> None:
    """Write JSON with sorted keys and a trailing newline, so equal content gives equal bytes."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    write_bytes_atomic(final, text.encode("utf-8"))


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
