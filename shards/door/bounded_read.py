"""Untrusted files and JSON text read whole, within bounds: regular files only, a size cap, a nesting cap.

Manifests, run configs, ``metrics.jsonl``, key lists and JSON Lines rows may come from anyone, so reading one must
neither hang nor take unbounded memory nor end in a raw ``RecursionError``:

- ``open`` on a FIFO blocks until a writer appears and ``/dev/zero`` never ends: a file is ``stat``-ed first and
  refused unless regular, then opened non-blocking (a file swapped for a FIFO after the check cannot block either)
  and checked again on its descriptor.
- At most ``MAX_FILE_BYTES`` are read, checked on the size ``stat`` reports and again while reading (a file may
  grow). 1 GiB is generous: a ``dataset.json`` costs about 15 bytes per (shard, class) pair for its per-shard
  class counts, so 10,000 shards of a 7,000-class dataset still fit, and a key list of 10 million of the longest
  keys ``pack-shards`` makes (77 characters) is 780 MB.
- CPython's parser recurses once per nesting level and gives up near the interpreter's recursion limit, and any
  code walking the value recurses too: JSON nested deeper than ``MAX_JSON_DEPTH`` is refused. Nothing shardcache
  writes nests beyond a handful of levels; the check is an iterative walk of the parsed value (only when the text
  holds more brackets than the limit), so it is linear in time and takes no stack.

``parse_json`` and the JSON Lines reader (``shards.door.jsonlines``) are the one way untrusted JSON text becomes a
value; ``read_json_file`` and ``read_regular_file`` the one way such a file is read whole, and
``open_regular_file`` the way one is opened to be streamed (a CSV list). The value's shape is then checked with
``shards.door.shape``. Third-party parsers (pyarrow, h5py, torch.load, numpy, PIL) run inside ``parser_guard``, which
turns what they raise on hostile bytes (``MemoryError``, ``RecursionError``, ``OverflowError`` and their own
exceptions) into one ``ShardcacheError`` naming the file: together these are the one door of docs/trust-model.md.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import stat
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterable, Iterator

from shards.errors import CorruptDataError, InputError, ManifestError, MissingInputError, ShardcacheError
from shards.units import human_bytes

MAX_JSON_DEPTH = 64
MAX_FILE_BYTES = 1 << 30
READ_BLOCK = 8 << 20  # bytes per read of a whole file: a manifest is a few MB at most

_FILE_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
               (stat.S_ISBLK, "block device"), (stat.S_ISDIR, "directory"))


class JSONError(ValueError):
    """Text that is not JSON shardcache will read: malformed, not UTF-8, or nested deeper than ``MAX_JSON_DEPTH``.

    ``str()`` is the whole reason (``not valid JSON (Expecting value: line 1 column 9 (char 8))``); ``msg`` the
    reason alone (``Expecting value``), for a JSON Lines caller that names the line itself."""

    def __init__(self, message: str, msg: str | None = None):
        super().__init__(message)
        self.msg = msg or message


def not_regular_reason(mode: int) -> str | None:
    """Why a file of this ``st_mode`` is not read (``"not a regular file (FIFO)"``), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "special file")
    return f"not a regular file ({kind})"


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests more than ``limit`` containers deep; level by level, so no recursion."""
    level, depth = [value], 0
    while level:
        depth += 1
        if depth > limit:
            return True
        children: list[Any] = []
        for node in level:
            members = node.values() if type(node) is dict else node
            children += [m for m in members if type(m) is dict or type(m) is list]
        level = children
    return False


def first_repeat(names: Iterable[str]) -> str | None:
    """The first name that ``names`` gives a second time (a JSON object's key, a CSV header's column), or None."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ValueError(f"key {first_repeat(key for key, _ in pairs)[:80]!r} appears twice in one object")
    return value


def parse_json(text: str | bytes, *, max_depth: int = MAX_JSON_DEPTH, unique_keys: bool = False) -> Any:
    """The value of JSON ``text`` (bytes must be UTF-8); ``JSONError`` when malformed, not UTF-8 or too deep.
    ``unique_keys``: an object with a key twice is malformed too (for rows a person wrote, where the last value
    silently winning would pack something else than they meant; off where the cost counts: indexes, metrics)."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys) if unique_keys else json.loads(text)
        # A text with no more brackets than the limit cannot nest deeper: most JSON Lines rows skip the walk.
        too_deep = text.count("[") + text.count("{") > max_depth and _deeper_than(value, max_depth)
    except json.JSONDecodeError as exc:
        raise JSONError(f"not valid JSON ({exc})", exc.msg) from None
    except ValueError as exc:  # an integer of more digits than int() converts (4,300), or a key twice
        if "appears twice" in str(exc):
            raise JSONError(f"not valid JSON here ({exc})", str(exc)) from None
        raise JSONError(f"not valid JSON ({exc})".split(";")[0] + ")", "number too long") from None
    except RecursionError:  # deeper than the interpreter's limit, so deeper than ours
        too_deep = True
    if too_deep:
        raise JSONError(f"nested deeper than {max_depth} levels")
    return value


def open_regular_file(path: str | os.PathLike, *, error: type[ShardcacheError] = InputError,
                      follow_symlinks: bool = True) -> BinaryIO:
    """``path`` opened for reading in binary if it is a regular file; else ``error`` naming it
    (``MissingInputError`` when it does not exist). ``stat`` first, so a FIFO or device is never opened; the open
    is non-blocking and the descriptor checked again, so one swapped in after the check cannot block either.
    ``follow_symlinks=False`` (a folder other users write, such as the node cache): a symlink is refused, also one
    swapped in after the check (``O_NOFOLLOW``)."""
    where = str(path)
    try:
        mode = (os.stat if follow_symlinks else os.lstat)(path).st_mode
        if stat.S_ISLNK(mode):
            raise error("a symbolic link (not followed here)", path=where)
    except FileNotFoundError:
        raise MissingInputError("no such file", path=where) from None
    except OSError as exc:
        raise error(f"cannot read ({exc.strerror or exc})", path=where) from None
    reason = not_regular_reason(mode)
    if reason is None:
        try:
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
            handle = os.fdopen(os.open(path, flags), "rb")
        except OSError as exc:
            if exc.errno == errno.ELOOP and not follow_symlinks:
                raise error("a symbolic link (not followed here)", path=where) from None
            raise error(f"cannot read ({exc.strerror or exc})", path=where) from None
        reason = not_regular_reason(os.fstat(handle.fileno()).st_mode)
        if reason is None:
            return handle
        handle.close()
    raise error(reason, path=where)


def read_regular_file(path: str | os.PathLike, *, limit: int = MAX_FILE_BYTES,
                      error: type[ShardcacheError] = InputError, follow_symlinks: bool = True) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes (checked on its size before
    reading, and while reading); else ``error`` naming the file (``MissingInputError`` when it does not exist)."""
    where = str(path)
    with open_regular_file(path, error=error, follow_symlinks=follow_symlinks) as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise error(f"{human_bytes(size)}: larger than the {human_bytes(limit)} shardcache reads whole",
                        path=where)
        try:
            return read_capped(handle, where, limit=limit, error=error)
        except OSError as exc:
            raise error(f"cannot read ({exc.strerror or exc})", path=where) from None


def read_capped(stream: BinaryIO, where: str, *, limit: int = MAX_FILE_BYTES,
                error: type[InputError] = ManifestError) -> bytes:
    """All of ``stream`` (a file grown since its ``stat``, an HTTP body), or ``error`` once it passes ``limit``.

    Read in blocks: ``read(limit + 1)`` allocates ``limit + 1`` bytes up front (1 GiB for every manifest), which a
    node with strict overcommit or ``ulimit -v`` refuses."""
    chunks, total = [], 0
    while True:
        chunk = stream.read(min(READ_BLOCK, limit + 1 - total))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise error(f"more than the {human_bytes(limit)} shardcache reads whole", path=where)


def read_json_file(path: str | os.PathLike, *, limit: int = MAX_FILE_BYTES, follow_symlinks: bool = True) -> Any:
    """The JSON value in file ``path`` (a manifest, a run config, a record); every problem is a ``ManifestError``
    naming the file, a missing file a ``MissingInputError``."""
    data = read_regular_file(path, limit=limit, error=ManifestError, follow_symlinks=follow_symlinks)
    try:
        return parse_json(data)
    except JSONError as exc:
        raise ManifestError(str(exc), path=str(path)) from None


# What a third-party parser may raise on hostile bytes besides its own exception types: resources asked for by a
# declared size (MemoryError, OverflowError), nesting (RecursionError), and the generic errors parsers let escape
# (ValueError, TypeError, KeyError, IndexError, EOFError, UnicodeError, OSError, RuntimeError from torch and h5py).
PARSER_FAILURES: tuple[type[BaseException], ...] = (
    MemoryError, RecursionError, OverflowError, ValueError, TypeError, KeyError, IndexError, EOFError,
    UnicodeError, OSError, RuntimeError, AssertionError, pickle.UnpicklingError)

# torch's weights-only refusal: "Weights only load failed. ... Re-running `torch.load` with `weights_only` set to
# `False` will likely succeed, but it can result in arbitrary code execution. ... WeightsUnpickler error: <reason>
# Please use `torch.serialization.add_safe_globals([...])` ...". Only the reason is kept: repeating the advice to
# load with ``weights_only=False`` would tell a user to run the file's code.
_REFUSAL = re.compile(r"WeightsUnpickler error:\s*(.*?)\s*(?:Please use|Check the documentation|$)", re.S)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, pickle.UnpicklingError):
        match = _REFUSAL.search(_ANSI.sub("", str(exc)))
        detail = " ".join(match.group(1).split()).rstrip(".") if match else "not a weights-only file"
        detail = detail if len(detail) <= 200 else detail[:197] + "..."
        return (f"torch.load(weights_only=True) refused it: {detail}; shardcache never unpickles Python "
                "objects")
    text = _ANSI.sub("", str(exc)).strip().splitlines()
    reason = text[0] if text else ""
    reason = reason if len(reason) <= 200 else reason[:197] + "..."
    return f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__


@contextmanager
def parser_guard(where: str, what: str, *, error: type[ShardcacheError] = CorruptDataError,
                 catch: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Run a third-party parser on untrusted bytes: any failure becomes one ``error`` naming ``where``
    (``... : cannot read Parquet metadata (OSError: Couldn't deserialize thrift)``).

    A ``ShardcacheError`` raised inside (a shape check) passes through unchanged; ``catch`` adds a parser's own
    exception types that derive from none of ``PARSER_FAILURES`` (``pyarrow.ArrowException``). What the guard
    cannot turn into an error is an abort inside C code: such parsers are given only input validated first."""
    try:
        yield
    except ShardcacheError:
        raise
    except (PARSER_FAILURES + catch) as exc:
        raise error(f"{what} ({_first_line(exc)})", path=where) from None


def load_weights_only(source: str | os.PathLike | BinaryIO, where: str, what: str, *,
                      error: type[ShardcacheError] = CorruptDataError, mmap: bool = False) -> Any:
    """``torch.load(source, weights_only=True)`` through the door: a path must be a regular file (checked before
    torch opens it), and every failure is one ``error`` line naming ``where`` (``what`` says what the file was
    meant to be); a refused pickle names what it refused, never torch's advice to set ``weights_only=False``.
    ``mmap`` needs a path (a feature shard mapped rather than read)."""
    import torch

    if isinstance(source, (str, os.PathLike)):
        open_regular_file(source, error=error).close()
    with parser_guard(where, what, error=error):
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
