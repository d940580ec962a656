"""The table read and checked for ``pack-shards --table``: CSV cells, input columns, target, splits, parsed inputs.

Kept apart from the encoding and the writing because every check here runs before anything is fitted or written,
and because ``TableEncoding.encode_rows`` parses new rows with the same ``parse_inputs``, so a cell that packing
would refuse is refused there too. A bad cell is an ``InputError`` naming the file, the spreadsheet row (the
header is row 1) and the column; nothing here guesses a value.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from shards.atomic import sha256_file
from preprocess.pack.sources.csv_records import SPLIT_NAME, SPLIT_NAME_RULE, read_csv_records
from preprocess.pack.plan import stratified_val
from preprocess.pack.table.config import TableConfig
from shards.errors import InputError, MissingInputError

log = logging.getLogger("shardcache.pack")

SPLIT_COLUMN = "split"
DEFAULT_VAL_FRACTION = 0.2
MAX_INFERRED_CLASSES = 20  # integer targets with more distinct values are inferred to be regression
UNKNOWN_CODE = -1  # a category the train split never had (or a missing one, with --impute)
# Read as missing, compared case-insensitively after stripping spaces ("None" stays a category name).
MISSING_CELLS = frozenset({"", "na", "n/a", "#n/a", "nan", "null", "?"})
# float() would also take inf, nan and 1_000. One way to match each digit, so a long cell that is no number fails
# in linear time (``\d+\.?\d*`` backtracks quadratically: seconds for a 10,000-digit cell).
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?\Z")
_INTEGER = re.compile(r"^[+-]?\d{1,4000}\Z")  # int() refuses more than 4,300 digits; a longer one is a float
FLOAT32_MAX = float(np.finfo(np.float32).max)  # feature and target shards store float32


@dataclass(frozen=True)
class Table:
    """A CSV file's stripped cells by column, and each record's spreadsheet row number (the header is row 1)."""

    path: str
    sha256: str
    header: tuple[str, ...]
    row_numbers: tuple[int, ...]
    cells: Mapping[str, tuple[str, ...]]

    def __len__(self) -> int:
        return len(self.row_numbers)

    def error(self, index: int, column: str, message: str) -> InputError:
        return InputError(f"row {self.row_numbers[index]}, column {column!r}: {message}", path=self.path)


def read_table(path: str) -> Table:
    """Read a CSV file whose first row names unique columns and whose every record has as many cells."""
    source = Path(path)
    if not source.exists():
        raise MissingInputError("no such file", path=path)
    if not source.is_file():
        raise InputError("is not a file; --table reads one CSV file", path=path)
    header, records = read_csv_records(source, "naming the columns")
    _check_header(header, path)
    if not records:
        raise InputError("no data rows below the header", path=path)
    cells = {name: tuple(record[i] for _, record in records) for i, name in enumerate(header)}
    return Table(path, sha256_file(source), tuple(header), tuple(number for number, _ in records), cells)


def _check_header(header: Sequence[str], path: str) -> None:
    """Every column named, no name twice; one pass with a set, so a header of 100,000 columns takes milliseconds."""
    seen: set[str] = set()
    for position, name in enumerate(header, 1):
        if not name:
            raise InputError(f"row 1: column {position} of the header has no name", path=path)
        if name in seen:
            raise InputError(f"row 1: column {name!r} appears twice in the header", path=path)
        seen.add(name)


def _is_missing(cell: str) -> bool:
    return cell.lower() in MISSING_CELLS


def _is_float_word(cell: str) -> bool:
    """A cell Python's ``float`` takes that is no plain number: ``inf``, ``-Infinity``, ``1_000``."""
    try:
        float(cell)
    except ValueError:
        return False
    return True


def finite_moments(table: Table, column: str, values: np.ndarray, rows: np.ndarray) -> tuple[float, float]:
    """The mean and standard deviation of ``values`` (float64, the table rows ``rows`` of ``column``), or an
    ``InputError`` naming the row of the largest magnitude when they overflow (cells near 1e308 sum to inf, near
    1e154 square to inf): standardising with them would make every value NaN."""
    with np.errstate(over="ignore", invalid="ignore"):
        mean, std = float(values.mean()), float(values.std())
    if math.isfinite(mean) and math.isfinite(std):
        return mean, std
    worst = int(np.argmax(np.abs(values)))
    raise table.error(int(rows[worst]), column, f"{values[worst]:g} is too large to standardise: the train split's "
                      "mean or standard deviation of the column overflows; rescale the column")


class Layout(NamedTuple):
    inputs: tuple[str, ...]
    categorical: frozenset[str]
    split_column: str | None


def resolve_columns(table: Table, cfg: TableConfig) -> Layout:
    """Which columns are inputs, which of them categorical, and whether a ``split`` column assigns the splits."""
    for option, wanted in (("--target", (cfg.target,)), ("--columns", cfg.columns or ()),
                           ("--categorical", cfg.categorical)):
        unknown = [name for name in wanted if name not in table.cells]
        if unknown:
            raise InputError(f"{option}: no column {unknown[0]!r}; the header has {', '.join(table.header)}",
                             path=table.path)
    chosen = cfg.columns or ()
    split_column = SPLIT_COLUMN if SPLIT_COLUMN in table.cells and SPLIT_COLUMN not in (cfg.target, *chosen) else None
    inputs = chosen or tuple(name for name in table.header if name not in (cfg.target, split_column))
    if cfg.target in inputs:
        raise InputError(f"--columns includes the target {cfg.target!r}", path=table.path)
    outside = [name for name in cfg.categorical if name not in inputs]
    if outside:
        raise InputError(f"--categorical {outside[0]!r} is not an input column", path=table.path)
    if not inputs:
        raise InputError("no input columns besides the target", path=table.path)
    return Layout(tuple(inputs), frozenset(cfg.categorical), split_column)


class Target(NamedTuple):
    task: str
    classes: tuple[str, ...]  # sorted (numerically for integer labels); () for regression
    labels: np.ndarray  # int64 [N]; all 0 for regression
    values: np.ndarray | None  # float64 [N] for regression


def parse_target(table: Table, cfg: TableConfig) -> Target:
    """Classification for strings and for integers with few distinct values, regression otherwise (``--task``)."""
    cells = table.cells[cfg.target]
    for i, cell in enumerate(cells):
        if _is_missing(cell):
            raise table.error(i, cfg.target, "the target is missing; remove the rows that have none")
    integer = all(_INTEGER.match(cell) for cell in cells)
    task = cfg.task
    if task == "auto":
        odd = [i for i, cell in enumerate(cells) if not _NUMBER.match(cell)]
        if odd and all(_is_float_word(cells[i]) for i in odd):
            # "inf" among numbers is a broken regression target, not a reason to make every value a class.
            raise table.error(odd[0], cfg.target, f"{cells[odd[0]]!r} is not a finite number, and every other "
                              "target is a number; fix the cell, or pass --task classification to make the values "
                              "class names")
        few = integer and len({int(cell) for cell in cells}) <= MAX_INFERRED_CLASSES
        task = "classification" if few or odd else "regression"
        log.info("target %r: %s (inferred; --task overrides)", cfg.target, task)
    if task == "regression":
        bad = next((i for i, cell in enumerate(cells) if not _NUMBER.match(cell)), None)
        if bad is not None:
            raise table.error(bad, cfg.target, f"{cells[bad]!r} is not a number (a regression target)")
        values = np.array([float(cell) for cell in cells])
        # Targets are stored as float32; a larger one would be stored as inf (and its statistics overflow).
        bad = next((i for i, value in enumerate(values) if not abs(value) <= FLOAT32_MAX), None)
        if bad is not None:
            raise table.error(bad, cfg.target, f"{cells[bad]!r} does not fit the float32 targets are stored as "
                              f"(at most {FLOAT32_MAX:.3g} in magnitude)")
        if values.min() == values.max():
            raise InputError(f"target {cfg.target!r} is {values[0]:g} in every row; nothing to learn",
                             path=table.path)
        return Target(task, (), np.zeros(len(cells), np.int64), values)
    # Integer labels sort as numbers, so labels 0..K-1 keep their index as the class index.
    names = [str(int(cell)) for cell in cells] if integer else list(cells)
    classes = tuple(sorted(set(names), key=int if integer else None))
    if len(classes) < 2:
        raise InputError(f"target {cfg.target!r} has one class ({classes[0]!r}); nothing to learn", path=table.path)
    index = {name: i for i, name in enumerate(classes)}
    return Target(task, classes, np.array([index[name] for name in names], np.int64), None)


def assign_splits(table: Table, layout: Layout, target: Target, cfg: TableConfig) -> tuple[np.ndarray, float]:
    """Each row's split: the split column's (as in image lists), else train with a seeded val carved out."""
    if layout.split_column is not None:
        names = table.cells[layout.split_column]
        for i, name in enumerate(names):
            if _is_missing(name):
                raise table.error(i, layout.split_column, "no split name; give every row one (train, val...)")
            if not SPLIT_NAME.match(name):
                raise table.error(i, layout.split_column, f"split {name[:80]!r} is not {SPLIT_NAME_RULE}")
        split_of = np.array(names)
        fraction = cfg.val_fraction or 0.0
        if fraction and "val" in names:
            raise InputError(f"--val-fraction {fraction} given, but the split column already names val rows",
                             path=table.path)
    else:
        split_of = np.array(["train"] * len(table), dtype="<U5")
        fraction = DEFAULT_VAL_FRACTION if cfg.val_fraction is None else cfg.val_fraction
    if fraction:
        split_of = split_of.astype(f"<U{max(split_of.itemsize // 4, 3)}")
        split_of[_carve_val(np.flatnonzero(split_of == "train"), target, fraction, cfg.seed)] = "val"
    if not (split_of == "train").any():
        raise InputError("no train rows: the statistics that scale every split are fitted on the train split",
                         path=table.path)
    return split_of, fraction


def _carve_val(train_rows: np.ndarray, target: Target, fraction: float, seed: int) -> list[int]:
    """The same fraction of every class (of all rows, for regression), chosen from the seed and the class name as
    image packing does, so the choice within one class does not depend on the others."""
    groups = {"": train_rows}
    if target.task == "classification":
        groups = {name: train_rows[target.labels[train_rows] == k] for k, name in enumerate(target.classes)}
    return sorted(stratified_val({name: rows.tolist() for name, rows in groups.items()}, fraction, seed))


def parse_inputs(table: Table, inputs: Sequence[str], categorical: frozenset[str], impute: bool) -> dict[str, Any]:
    """Numeric columns as float64 (NaN where missing), categorical ones as strings (None where missing).

    Every cell is checked before anything is raised, so the error names the first bad cell (by row, then column)
    and how many there are: one run tells the whole story of a dirty file."""
    parsed: dict[str, Any] = {}
    problems: list[tuple[int, int, str, str]] = []
    for position, name in enumerate(inputs):
        cells = table.cells[name]
        missing = [_is_missing(cell) for cell in cells]
        if name in categorical:
            parsed[name] = [None if gone else cell for cell, gone in zip(cells, missing)]
            if not impute:
                problems.extend((i, position, name, "missing category; pass --impute to encode it as unknown "
                                 f"(all-zero one-hot, code {UNKNOWN_CODE})") for i, gone in enumerate(missing) if gone)
            continue
        values = np.full(len(cells), np.nan)
        for i, (cell, gone) in enumerate(zip(cells, missing)):
            if gone:
                if not impute:
                    problems.append((i, position, name, "missing value; pass --impute mean|median|zero to fill it "
                                     "from the train split"))
            elif _NUMBER.match(cell) and math.isfinite(float(cell)):
                values[i] = float(cell)
            else:
                problems.append((i, position, name, f"{cell!r} is not a number; name the column in --categorical, "
                                 "or leave it out with --columns"))
        parsed[name] = values
    if problems:
        row, _, name, message = min(problems)
        more = f" ({len(problems)} bad cells in all)" if len(problems) > 1 else ""
        raise table.error(row, name, message + more)
    return parsed
