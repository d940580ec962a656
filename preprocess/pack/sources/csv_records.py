"""A CSV file as a header and its records, for the image lists and the tables ``pack-shards`` reads.

One reader so both inputs agree: Excel's "CSV UTF-8" byte order mark is dropped (``utf-8-sig``), cells are
stripped, blank records are skipped but still counted, every record must have as many cells as the header, and a
record is named by the line it starts on. A file that is not UTF-8 or not valid CSV is a one-line ``InputError``
naming the file, never a traceback; so is a FIFO or device, refused before it is opened (``open_regular_file``).
"""

from __future__ import annotations

import csv
import io
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from shards.door.bounded_read import first_repeat, open_regular_file
from shards.errors import InputError

# What a split column's values may be: also shard name prefixes, so short enough for a file name with its suffix.
SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]{1,64}\Z")
SPLIT_NAME_RULE = "a plain name: letters, digits, _, at most 64 characters"


def read_csv_records(path: str | Path, expected: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """``(header, [(row number, cells), ...])``; ``expected`` says what the header should hold, for the error an
    empty file gets."""
    header, records = iter_csv_records(path, expected)
    return header, list(records)


def iter_csv_records(path: str | Path, expected: str) -> tuple[list[str], Iterator[tuple[int, list[str]]]]:
    """``read_csv_records`` with the records read as they are consumed (an image list of millions of rows is
    never held as rows); the file stays open until they are all read."""
    where = str(path)
    handle = io.TextIOWrapper(open_regular_file(path), encoding="utf-8-sig", newline="")
    try:
        with _csv_errors(where, 1):
            reader = csv.reader(handle)
            header = [name.strip() for name in next(reader, [])]
        if not header:
            raise InputError(f"empty file (expected a header row {expected})", path=where)
        twice = first_repeat(header)
        if twice is not None:  # which of the two would a row's cell be? refused, not the last one silently
            raise InputError(f"row 1: column {twice[:80]!r} appears twice in the header", path=where)
    except BaseException:
        handle.close()
        raise
    return header, _records(handle, reader, header, where)


def _records(handle: io.TextIOWrapper, reader, header: list[str], where: str) -> Iterator[tuple[int, list[str]]]:
    start = reader.line_num + 1
    with handle:
        while True:
            with _csv_errors(where, start):
                record = next(reader, None)
            if record is None:
                return
            if any(cell.strip() for cell in record):
                if len(record) != len(header):
                    raise InputError(f"row {start}: {len(record)} cells, the header has {len(header)}", path=where)
                yield start, [cell.strip() for cell in record]
            start = reader.line_num + 1


@contextmanager
def _csv_errors(where: str, row: int) -> Iterator[None]:
    """A file that is not UTF-8 or not valid CSV is a one-line ``InputError`` naming the file and the row."""
    try:
        yield
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=where) from None
    except csv.Error as exc:
        raise InputError(f"row {row}: not valid CSV ({exc})", path=where) from None
