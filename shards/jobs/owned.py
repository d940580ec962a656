"""What ``--overwrite`` may delete in an output folder: the files that the output being replaced names, nothing else.

An output folder may hold a user's own files beside ours, some of them named like ours (``train-000099.tar`` kept
from another project, a ``model.pt``). Deciding by name pattern deleted those. Here a file is ours only when the
manifest being replaced (``dataset.json``, ``features.json``, a run's ``config.json``) or the stage's own records
(``.pack/``, ``.precompute/``) name it; every writer (``pack-shards``, ``precompute-features``,
``train-from-shards``) asks these functions, so the rule has one definition:

- ``plain_names``: only plain file names at the top of the folder count (what our writers create); a record naming
  ``sub/x``, ``../x`` or a URL names nothing we may delete.
- ``refuse_clobber``: before anything is written, a file this run would write over that the replaced output does
  not name is refused (exit 2, naming it): left alone, it is never silently replaced either.
- ``remove_owned``: delete exactly the named files, the temp files a killed run left of them, and the records in the
  stage folder (its lock files stay: the running job holds them); log what stays beside them. Files a layout keeps
  in subfolders (the column index, ``columns/<split>/c000.npy``) are named by relative path (``nested``); only
  those matching the layout's own pattern count, and none is followed through a symlinked folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Collection, Iterable

from shards.atomic import remove_stale_tmp
from shards.door.bounded_read import read_json_file
from shards.errors import OutputExistsError, ShardcacheError
from shards.lock import is_lock_file

log = logging.getLogger("shardcache.overwrite")
_NOT_PLAIN = re.compile(r"[/\\\x00-\x1f\x7f]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
SHOWN_NAMES = 3


def plain_names(names: Iterable[object]) -> set[str]:
    """The plain file names among ``names`` (record values are untrusted: anything else is dropped)."""
    return {name for name in names
            if isinstance(name, str) and name not in ("", ".", "..") and not _NOT_PLAIN.search(name)}


def manifest_names(folder: Path, manifest_file: str, load: Callable[[Path], Any],
                   names_of: Callable[[Any], Iterable[object]]) -> list[object]:
    """The manifest file of ``folder`` and what ``names_of`` finds in it, once ``load`` reads it. An unreadable
    manifest names only itself (it is replaced, what it may have named stays), and only if it says it is one of
    ours (``"format": "shardcache...."``: a damaged one); a ``dataset.json`` of the user's own is not ours, so it
    is refused, never replaced."""
    if not (folder / manifest_file).is_file():
        return []
    try:
        manifest = load(folder)
    except ShardcacheError:
        return [manifest_file] if declares_ours(folder / manifest_file) else []
    return [manifest_file, *names_of(manifest)]


def declares_ours(path: Path) -> bool:
    """Whether the JSON object in ``path`` (read through the door: bounded) names a shardcache format."""
    try:
        data = read_json_file(path)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("format"), str) and data["format"].startswith("shardcache.")


def shown(names: Collection[str]) -> str:
    """``a, b, c, ...``: the first few names, enough to find them, in one line (a name's control characters are
    shown escaped, as ``repr`` does: a name is untrusted text, a listed object key or a file a user made)."""
    ordered = sorted(names)
    first = [_CONTROL.sub(lambda match: repr(match.group())[1:-1], name) for name in ordered[:SHOWN_NAMES]]
    return ", ".join(first) + (", ..." if len(ordered) > SHOWN_NAMES else "")


def refuse_clobber(folder: Path, owned: Collection[str], writes: Collection[str], *, writer: str) -> None:
    """``OutputExistsError`` when a file of ``folder`` that this run would write is not ``owned`` (not named by the
    output being replaced): a user's file that merely has one of our names."""
    blocking = [name for name in writes if name not in owned and os.path.lexists(folder / name)]
    if blocking:
        raise OutputExistsError(f"holds {len(blocking)} file(s) that {writer} did not write here but would replace "
                                f"({shown(blocking)}); --overwrite removes only what the old output names: move "
                                "them away or choose another --out", path=str(folder))


def nested_names(names: Iterable[object], pattern: re.Pattern[str]) -> set[str]:
    """The relative paths among ``names`` (untrusted record values) that ``pattern`` (a layout's subfolder files,
    matched whole) accepts and whose every part is a plain name."""
    return {name for name in names if isinstance(name, str) and pattern.fullmatch(name)
            and all(plain_names([part]) for part in name.split("/"))}


def remove_nested(folder: Path, names: Collection[str]) -> None:
    """Delete each relative path of ``names`` inside ``folder``, its temp files, and the subfolders it empties;
    a path whose folder resolves elsewhere (a symlinked subfolder) is left alone."""
    root = os.path.realpath(folder)
    parents: set[Path] = set()
    for name in names:
        path = folder / name
        if os.path.realpath(path.parent) != os.path.join(root, os.path.dirname(name)):
            continue
        with contextlib.suppress(FileNotFoundError):
            if path.is_symlink() or not path.is_dir():
                path.unlink()
        remove_stale_tmp(path.parent, {path.name})
        parents.update(p for p in path.relative_to(folder).parents if p != Path("."))
    for parent in sorted(parents, key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty (a file we do not own), or gone
            (folder / parent).rmdir()


def remove_owned(folder: Path, owned: Collection[str], state_dir: str | None = None,
                 nested: Collection[str] = ()) -> list[str]:
    """Delete the ``owned`` files of ``folder`` (a link, not its target), the ``nested`` ones (relative paths the
    caller checked with ``nested_names``), their temp files and the stage folder's records (lock files stay);
    return what stays, which one log line names."""
    for name in plain_names(owned):
        path = folder / name
        if path.is_symlink() or not path.is_dir():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    remove_stale_tmp(folder, plain_names(owned))
    remove_nested(folder, nested)
    state = folder / state_dir if state_dir else None
    if state is not None and state.is_dir() and not state.is_symlink():
        for record in state.iterdir():
            if record.is_file() and not record.is_symlink() and not is_lock_file(record.name):
                record.unlink()
    left = sorted(entry.name for entry in folder.iterdir() if entry.name != state_dir)
    if left:
        log.info("--overwrite left %d entr%s in %s that the replaced output does not name: %s", len(left),
                 "y" if len(left) == 1 else "ies", folder, shown(left))
    return left
