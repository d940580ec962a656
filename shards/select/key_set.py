"""Sample key lists (a subset's ``keys``, ``exclude_keys``) held compactly and read from untrusted files.

A key list can name millions of samples, and a ``frozenset[str]`` of them took five times the file's size, so the
keys live as sorted bytes in numpy arrays and are tested a whole column at a time. The file is read a bounded block
at a time from a regular file only (a FIFO or ``/dev/zero`` would hang or fill memory), with one-line errors that
name the file, the line and the byte.
"""

from __future__ import annotations

import codecs
import os
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from shards.door.bounded_read import MAX_FILE_BYTES, open_regular_file
from shards.errors import InputError
from shards.units import human_bytes


def read_keys(keys: Any) -> KeySet | None:
    """Sample keys from a file (a path: one per line, blank lines and surrounding spaces ignored) or as given."""
    if keys is None:
        return None
    if isinstance(keys, (str, os.PathLike)):
        return KeySet.read(keys)
    return KeySet.of(keys)


KEY_BLOCK = 1 << 20  # bytes of a key list parsed at a time: the text, lines and bytes of one block are transient
MAX_KEY_LINE_BYTES = 1 << 16  # a key list's line: keys are short (pack-shards' longest is 77 characters)


class KeySet:
    """A set of sample keys held as sorted, distinct UTF-8 bytes in numpy arrays, one per key length rounded up
    to a multiple of 8 (so a few long keys do not pad every short one): about the keys' own bytes, with no Python
    object per key. A list of 10 million keys is a few hundred MB where a ``frozenset[str]`` took five times its
    file. ``in`` is a binary search; ``member`` marks the rows of a fixed-width key column (a column index's).

    A key ending in a NUL character cannot be told from a shorter one in a fixed-width array (numpy strips
    trailing NULs), as in ``member_bytes``: such keys are never members. Keys shardcache makes hold none."""

    def __init__(self, tables: dict[int, np.ndarray]):
        self._tables = tables  # width -> sorted distinct keys of (width - 8, width] bytes, as ``S<width>``

    @classmethod
    def of(cls, keys: Iterable[str]) -> KeySet:
        """The keys given from Python (an iterable of ``str``)."""
        return cls._build([cls._encoded(str(k) for k in keys)])

    @classmethod
    def read(cls, path: str | os.PathLike) -> KeySet:
        """The keys of a file, one per line, parsed a block of ``KEY_BLOCK`` bytes at a time. A regular file of at
        most ``MAX_FILE_BYTES`` only: a FIFO or ``/dev/zero`` here would hang or fill memory."""
        chunks, rest, offset, total, lines = [], b"", 0, 0, 0  # offset: of ``rest`` in the file, for the errors
        with open_regular_file(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_FILE_BYTES:  # refused unread, as ``read_regular_file`` refuses a file to read whole
                raise InputError(f"{human_bytes(size)}: larger than the {human_bytes(MAX_FILE_BYTES)} shardcache "
                                 "reads whole", path=str(path))
            while True:
                block = handle.read(KEY_BLOCK)
                total += len(block)
                if total > MAX_FILE_BYTES:
                    raise InputError(f"more than the {human_bytes(MAX_FILE_BYTES)} shardcache reads whole",
                                     path=str(path))
                if total == len(block) and block.startswith(codecs.BOM_UTF8):  # Excel's "UTF-8" starts with one
                    block, offset = block[3:], 3
                data = rest + block
                # a line, or a character, may straddle blocks; ``rest`` stays under a line's bound, so each byte is
                # scanned a bounded number of times (a file with no newline is not re-scanned per block)
                cut = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1 if block else len(data)
                lines += data.count(b"\n", 0, cut) if b"\n" in data else data.count(b"\r", 0, cut)
                if len(data) - cut > MAX_KEY_LINE_BYTES:
                    raise InputError(f"line {lines + 1} (from byte {offset + cut}) is longer than "
                                     f"{human_bytes(MAX_KEY_LINE_BYTES)}: not a key list (one key per line)",
                                     path=str(path))
                try:
                    text = data[:cut].decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InputError(f"the keys file is not UTF-8 text ({exc.reason} at byte {offset + exc.start})",
                                     path=str(path)) from None
                chunks.append(cls._encoded(map(str.strip, text.replace("\r", "\n").split("\n"))))
                rest, offset = data[cut:], offset + cut
                if not block:
                    return cls._build(chunks)

    @staticmethod
    def _encoded(keys: Iterable[str]) -> dict[int, np.ndarray]:
        """Non-empty ``keys`` as UTF-8 bytes, by rounded width; unsorted. One list of the block's bytes, then
        numpy: a loop per key here was most of the time a large list took."""
        data = [k.encode("utf-8", "surrogatepass") for k in keys if k and k[-1] != "\0"]
        if not data:
            return {}
        every = np.asarray(data)
        del data
        widths = (np.char.str_len(every) + 7) // 8 * 8
        return {int(w): every[widths == w].astype(f"S{w}") for w in np.unique(widths)}

    @classmethod
    def _build(cls, chunks: list[dict[int, np.ndarray]]) -> KeySet:
        """Each width's chunks joined (and dropped as they are), sorted in place and made distinct."""
        tables = {}
        for width in sorted({w for chunk in chunks for w in chunk}):
            table = np.concatenate([chunk.pop(width) for chunk in chunks if width in chunk])
            table.sort()
            tables[width] = table[np.concatenate(([True], table[1:] != table[:-1]))] if len(table) else table
        return cls(tables)

    def __len__(self) -> int:
        return sum(len(table) for table in self._tables.values())

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, str) or not key or key.endswith("\0"):
            return False
        data = key.encode("utf-8", "surrogatepass")
        table = self._tables.get(-(-len(data) // 8) * 8)
        if table is None:
            return False
        at = int(np.searchsorted(table, data))
        return at < len(table) and table[at] == data

    def __iter__(self) -> Iterator[str]:
        """The keys, shortest widths first (each width sorted): for a caller that needs them as ``str``."""
        for table in self._tables.values():
            for data in table:
                yield data.decode("utf-8", "surrogatepass")

    def member(self, column: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
        """Which rows of a fixed-width ``S`` key column hold one of the keys: a binary search in each width's
        sorted keys, a chunk of rows at a time, each chunk cast to that width (so no copy of the keys is made). A
        row longer than a width's keys is not searched among them (the cast would cut it short)."""
        out = np.zeros(len(column), dtype=bool)
        for width, table in self._tables.items():
            for start in range(0, len(column), chunk):
                part = column[start:start + chunk]
                fits = np.char.str_len(part) <= width if width < column.dtype.itemsize else True
                part = part.astype(table.dtype)
                at = np.minimum(np.searchsorted(table, part), len(table) - 1)
                out[start:start + chunk] |= (table[at] == part) & fits
        return out

    def contains_each(self, keys: Sequence[str]) -> np.ndarray:
        """``[key in self for key in keys]`` as one search over the whole list (a shard's keys)."""
        column = np.asarray([b"" if k.endswith("\0") else k.encode("utf-8", "surrogatepass") for k in keys] or [b""])
        return self.member(column)[: len(keys)]
