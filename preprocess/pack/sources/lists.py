"""CSV and JSONL image lists as a packing source: rows of ``path,label[,split]``, relative paths relative to the
list's folder (two kinds, one text format each, read into the same rows).

Rows are checked and stat'ed as they are read, into columns: labels are numbered as they are first seen and
renumbered in sorted order at the end, so no row is held as Python objects (only each path, to refuse one listed
twice). A bad row is one ``InputError`` naming the list and the line; a listed file that does not exist is a typo
in the list (``MissingInputError``), while a dangling link or a FIFO is a skipped file like any other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

from preprocess.pack.sources.columns import SamplesBuilder
from preprocess.pack.sources.csv_records import SPLIT_NAME, SPLIT_NAME_RULE, iter_csv_records
from preprocess.pack.sources.kind import MAX_CLASS_CHARS, KindScan, ScanRequest, SkippedSource, add_file, found
from shards.door.bounded_read import read_regular_file
from shards.door.jsonlines import json_lines
from shards.door.shape import as_str
from shards.errors import InputError, MissingInputError

LIST_COLUMNS = ("path", "label", "split")
CSV_SUFFIXES = (".csv",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")

Rows = Iterable[tuple[int, dict[str, str]]]  # (line number, cells by column name)


def _is_list(source: str, suffixes: tuple[str, ...]) -> bool:
    path = Path(source)
    return path.suffix.lower() in suffixes and path.exists() and not path.is_dir()


def is_csv_list(source: str) -> bool:
    return _is_list(source, CSV_SUFFIXES)


def is_jsonl_list(source: str) -> bool:
    return _is_list(source, JSONL_SUFFIXES)


def scan_csv_list(source: str, request: ScanRequest) -> KindScan:
    return _scan_list(Path(source), _csv_rows, request.max_bytes)


def scan_jsonl_list(source: str, request: ScanRequest) -> KindScan:
    return _scan_list(Path(source), _jsonl_rows, request.max_bytes)


def _csv_rows(path: Path) -> Rows:
    header, records = iter_csv_records(path, "path,label[,split]")
    _check_columns(header, path, 1)
    for line_num, cells in records:
        yield line_num, dict(zip(header, cells))


def _jsonl_rows(path: Path) -> Rows:
    try:
        text = read_regular_file(path).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=str(path)) from None
    for line_num, row, bad in json_lines(text, unique_keys=True):
        if bad is not None:
            raise InputError(f"line {line_num}: not valid JSON ({bad})", path=str(path))
        if not isinstance(row, dict):
            raise InputError(f"line {line_num}: expected a JSON object", path=str(path))
        _check_columns(list(row), path, line_num)
        yield line_num, {name: _jsonl_cell(value, name, line_num, path) for name, value in row.items()}


def _jsonl_cell(value: object, name: str, line_num: int, path: Path) -> str:
    """A JSONL list's cell as text: a string (stripped), null (empty), or for a label an integer (``3`` names
    class "3", as a CSV cell would). Anything else is refused, not turned into text: ``str()`` would make a list,
    an object, ``true`` or ``NaN`` a class name or a path silently."""
    if value is None:
        return ""
    if name == "label" and type(value) is int:
        return str(value)
    return as_str(value, f"line {line_num}: {name}", where=str(path), error=InputError).strip()


def _check_columns(columns: list[str], path: Path, line_num: int) -> None:
    unknown = [c for c in columns if c not in LIST_COLUMNS]
    if unknown:
        raise InputError(f"line {line_num}: unknown column {unknown[0]!r} (allowed: {', '.join(LIST_COLUMNS)})",
                         path=str(path))
    for required in ("path", "label"):
        if required not in columns:
            raise InputError(f"line {line_num}: missing column {required!r}", path=str(path))


def _scan_list(path: Path, read_rows: Callable[[Path], Rows], max_bytes: int) -> KindScan:
    base = path.parent.resolve()
    builder = SamplesBuilder(str(base))
    skipped: list[SkippedSource] = []
    labels: dict[str, int] = {}  # label -> number in order of first appearance
    seen: dict[str, int] = {}
    with_split = set()
    for line_num, row in read_rows(path):
        where = f"line {line_num}"
        if not row.get("path"):
            raise InputError(f"{where}: empty path", path=str(path))
        if not row.get("label"):
            raise InputError(f"{where}: empty label", path=str(path))
        if len(row["label"]) > MAX_CLASS_CHARS:
            raise InputError(f"{where}: label longer than {MAX_CLASS_CHARS} characters ({len(row['label']):,})",
                             path=str(path))
        split = row.get("split") if "split" in row else None
        if split is not None and not SPLIT_NAME.match(split):
            raise InputError(f"{where}: split {split[:80]!r} is not {SPLIT_NAME_RULE}", path=str(path))
        file_path = Path(row["path"]) if Path(row["path"]).is_absolute() else base / row["path"]
        if not os.path.lexists(file_path):  # a dangling link is a skipped file, a missing one a typo in the list
            raise MissingInputError(f"{where}: no such file {row['path']!r}", path=str(path))
        rel_path = _relative_name(file_path, base)  # normalised: imgs/../imgs/x.jpg and ./imgs/x.jpg are imgs/x.jpg
        if rel_path in seen:
            raise InputError(f"{where}: {row['path']!r} is listed twice (first on line {seen[rel_path]})",
                             path=str(path))
        seen[rel_path] = line_num
        with_split.add(split is not None)
        add_file(builder, skipped, rel_path, labels.setdefault(row["label"], len(labels)), split, max_bytes)
    if not seen:
        raise InputError("lists no files", path=str(path))
    if len(with_split) > 1:
        raise InputError("some rows have a split and some do not", path=str(path))
    classes = tuple(sorted(labels))
    builder.renumber_labels([classes.index(name) for name in labels])
    scan = found(str(path.resolve()), classes, builder.build(), skipped)
    if not len(scan.samples):
        raise InputError(f"lists no packable files ({len(scan.skipped)} skipped: {scan.skipped[0].reason})",
                         path=str(path))
    return scan


def _relative_name(file_path: Path, base: Path) -> str:
    resolved = Path(os.path.normpath(file_path.absolute()))
    try:
        return resolved.relative_to(base).as_posix()
    except ValueError:
        return resolved.as_posix()
