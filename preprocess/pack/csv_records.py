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
from pathlib import Path

from shards.bounded_read import open_regular_file
from shards.errors import InputError

SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")  # what a split column's values may be (also shard name prefixes)


def read_csv_records(path: str | Path, expected: str) -> tuple[list[str], list[tuple[int, list[str]]]]:
    """``(header, [(row number, cells), ...])``; ``expected`` says what the header should hold, for the error an
    empty file gets."""
    where = str(path)
    records: list[tuple[int, list[str]]] = []
    start = 1
    try:
        with io.TextIOWrapper(open_regular_file(path), encoding="utf-8-sig", newline="") as handle:
            reader = csv.reader(handle)
            header = [name.strip() for name in next(reader, [])]
            if not header:
                raise InputError(f"empty file (expected a header row {expected})", path=where)
            start = reader.line_num + 1
            for record in reader:
                if any(cell.strip() for cell in record):
                    if len(record) != len(header):
                        raise InputError(f"row {start}: {len(record)} cells, the header has {len(header)}",
                                         path=where)
                    records.append((start, [cell.strip() for cell in record]))
                start = reader.line_num + 1
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=where) from None
    except csv.Error as exc:
        raise InputError(f"row {start}: not valid CSV ({exc})", path=where) from None
    return header, records
