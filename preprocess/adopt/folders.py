"""The folders ``shards index`` writes under ``INDEX``, made without following links.

``INDEX`` may sit where others can write (a shared project folder), and the index's names come from the source
(``part/a.tar.rows``): a planted ``INDEX/.adopt`` or ``INDEX/part`` symlink must not carry a part file, a staged
tar or a row index outside ``--out``. So each folder below ``INDEX`` is made one level at a time, and one that
exists is used only if it is a real folder (``lstat``), never a link; else ``InputError`` naming it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from shards.errors import InputError


def owned_folder(out: Path, rel: str) -> Path:
    """``out / rel`` (a ``/``-separated folder name), each level made here or found as a real folder, not a
    symlink; ``rel`` empty: ``out`` itself."""
    folder = out
    for part in (p for p in rel.split("/") if p):
        if part in (".", ".."):
            raise InputError(f"names the folder {rel!r}, which leaves the index folder", path=str(out))
        folder = folder / part
        try:
            os.mkdir(folder)
        except FileExistsError:
            pass
        mode = os.lstat(folder).st_mode
        if not stat.S_ISDIR(mode):
            what = "a symbolic link" if stat.S_ISLNK(mode) else "not a folder"
            raise InputError(f"is {what}; the index writes only real folders inside --out (remove it and run "
                             "again)", path=str(folder))
    return folder


__all__ = ["owned_folder"]
