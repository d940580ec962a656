"""Tables packed straight into feature shards: ``pack-shards table.csv --table --target COLUMN --out DIR``.

A table's columns already are features, so there is no image stage: its rows become float32 feature shards and a
``features.json`` in the format ``precompute-features`` writes, which ``shards.open_dataset`` and
``train-from-shards`` read unchanged. Everything that turned cells into numbers (the train split's means and
standard deviations, imputed values, categories, dropped columns) is recorded in ``features.json``'s ``config`` and
applied by ``TableEncoding``, so new rows are encoded exactly as the training rows were (``train-from-shards``
copies that config into ``model.pt``).

Bad cells are input errors, not guesses: a missing or non-numeric cell stops the job (exit 2, nothing written),
naming the file, the spreadsheet row (the header is row 1) and the column, unless ``--impute`` asks for missing
cells to be filled. Statistics come from the train split only, so nothing about val leaks into the inputs. A
regression target is stored as the feature format's ``targets`` (float32 [N]) beside all-zero placeholder labels,
and ``config.target`` records its train mean and std (``train-from-shards --task regression`` standardises with them).
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from preprocess.pack.parts import STATE_DIR
from preprocess.pack.plan import split_order_key
from shards.atomic import check_local_output, remove_stale_tmp, sha256_file, tmp_target
from shards.errors import InputError, MissingInputError, OutputExistsError, ShardcacheError
from shards.lock import claim_output
from shards.manifest import (DATASET_FILE, FEATURES_FILE, FeatureManifest, ShardInfo, SplitInfo,
                             load_feature_manifest)
from shards.formats.features import is_feature_file

log = logging.getLogger("shardcache.pack")

TASKS = ("auto", "classification", "regression")
ENCODINGS = ("onehot", "codes")
IMPUTE_STATISTICS = ("mean", "median", "zero")
TABLE_STORAGES = ("pt", "hdf5")
TABLE_KIND = "table"  # features.json config["kind"]: tells freshness checks there is no dataset.json behind it
FEATURE_DTYPE = "float32"
SPLIT_COLUMN = "split"
DEFAULT_VAL_FRACTION = 0.2
MAX_INFERRED_CLASSES = 20  # integer targets with more distinct values are inferred to be regression
UNKNOWN_CODE = -1  # a category the train split never had (or a missing one, with --impute)
# Read as missing, compared case-insensitively after stripping spaces ("None" stays a category name).
MISSING_CELLS = frozenset({"", "na", "n/a", "#n/a", "nan", "null", "?"})
_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")  # float() would also take inf, nan and 1_000
_INTEGER = re.compile(r"^[+-]?\d+$")
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")


@dataclass(frozen=True)
class TableConfig:
    """Every option of ``pack-shards --table``; all but ``out`` and ``overwrite`` shape the output."""

    source: str
    out: str
    target: str
    columns: tuple[str, ...] | None = None  # None: every column but the target and the split column
    categorical: tuple[str, ...] = ()
    encode: str = "onehot"
    impute: str | None = None
    task: str = "auto"
    val_fraction: float | None = None  # None: DEFAULT_VAL_FRACTION, or none when the table has a split column
    seed: int = 0
    shuffle: bool = True
    max_samples: int = 1000
    storage: str = "pt"
    overwrite: bool = False

    def __post_init__(self) -> None:
        check_local_output(self.out)
        if not self.target:
            raise InputError("--table needs --target COLUMN (the column to predict)")
        for name, value, allowed in (("task", self.task, TASKS), ("encode", self.encode, ENCODINGS),
                                     ("storage", self.storage, TABLE_STORAGES),
                                     ("impute", self.impute, (None, *IMPUTE_STATISTICS))):
            if value not in allowed:
                raise InputError(f"{name}={value!r}: choose one of {', '.join(map(str, allowed))}")
        if self.max_samples < 1:
            raise InputError(f"max_samples={self.max_samples}: must be at least 1")
        if self.val_fraction is not None and not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"val_fraction={self.val_fraction}: must be in [0, 1)")
        for name in ("columns", "categorical"):
            names = getattr(self, name) or ()
            twice = sorted({c for c in names if names.count(c) > 1})
            if twice:
                raise InputError(f"--{name} names {twice[0]!r} twice")


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
    numbers: list[int] = []
    records: list[list[str]] = []
    start = 1
    try:
        with open(source, newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle)
            header = [name.strip() for name in next(reader, [])]
            _check_header(header, path)
            start = reader.line_num + 1
            for record in reader:
                if any(cell.strip() for cell in record):  # blank lines are skipped, but still counted
                    if len(record) != len(header):
                        raise InputError(f"row {start}: {len(record)} cells, the header has {len(header)}", path=path)
                    numbers.append(start)
                    records.append(record)
                start = reader.line_num + 1
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=path) from None
    except csv.Error as exc:
        raise InputError(f"row {start}: not valid CSV ({exc})", path=path) from None
    if not records:
        raise InputError("no data rows below the header", path=path)
    cells = {name: tuple(record[i].strip() for record in records) for i, name in enumerate(header)}
    return Table(path, sha256_file(source), tuple(header), tuple(numbers), cells)


def _check_header(header: Sequence[str], path: str) -> None:
    if not header:
        raise InputError("empty file (expected a header row naming the columns)", path=path)
    for position, name in enumerate(header, 1):
        if not name:
            raise InputError(f"row 1: column {position} of the header has no name", path=path)
        if header.count(name) > 1:
            raise InputError(f"row 1: column {name!r} appears twice in the header", path=path)


def _is_missing(cell: str) -> bool:
    return cell.lower() in MISSING_CELLS


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
        numeric = all(_NUMBER.match(cell) for cell in cells)
        few = integer and len({int(cell) for cell in cells}) <= MAX_INFERRED_CLASSES
        task = "classification" if few or not numeric else "regression"
        log.info("target %r: %s (inferred; --task overrides)", cfg.target, task)
    if task == "regression":
        bad = next((i for i, cell in enumerate(cells) if not _NUMBER.match(cell)), None)
        if bad is not None:
            raise table.error(bad, cfg.target, f"{cells[bad]!r} is not a number (a regression target)")
        values = np.array([float(cell) for cell in cells])
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
            if not _SPLIT_NAME.match(name):
                raise table.error(i, layout.split_column, f"split {name!r} is not a plain name (letters, digits, _)")
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
    chosen: list[int] = []
    for name, rows in groups.items():
        members = rows.tolist()
        n_val = min(max(round(fraction * len(members)), 1), len(members) - 1) if len(members) >= 2 else 0
        random.Random(f"{seed}/val/{name}").shuffle(members)
        chosen.extend(members[:n_val])
    return sorted(chosen)


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


@dataclass(frozen=True)
class ColumnEncoding:
    """How one input column becomes features: ``(x - mean) / std`` for a number, one-hot or a code for a category."""

    name: str
    kind: str  # "numeric" or "categorical"
    mean: float = 0.0
    std: float = 1.0
    fill: float | None = None  # what a missing number becomes before scaling (--impute); None: an error
    categories: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "numeric":
            return {"name": self.name, "kind": self.kind, "mean": self.mean, "std": self.std, "fill": self.fill}
        return {"name": self.name, "kind": self.kind, "categories": list(self.categories)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ColumnEncoding":
        if data["kind"] == "numeric":
            fill = data.get("fill")
            return cls(str(data["name"]), "numeric", float(data["mean"]), float(data["std"]),
                       None if fill is None else float(fill))
        return cls(str(data["name"]), "categorical", categories=tuple(str(c) for c in data["categories"]))


@dataclass(frozen=True)
class TableEncoding:
    """The recipe from cells to a float32 feature row, fitted on the train split and recorded in ``features.json``
    (``to_config``), so rows seen later (val, or new rows to predict) are scaled as the training rows were."""

    columns: tuple[ColumnEncoding, ...]
    encode: str  # categorical columns: "onehot" or "codes"
    impute: str | None

    @property
    def feature_names(self) -> list[str]:
        names = []
        for column in self.columns:
            if column.kind == "categorical" and self.encode == "onehot":
                names.extend(f"{column.name}={category}" for category in column.categories)
            else:
                names.append(column.name)
        return names

    def to_config(self) -> dict[str, Any]:
        unknown = "all-zero one-hot" if self.encode == "onehot" else UNKNOWN_CODE
        return {"columns": [c.to_dict() for c in self.columns], "encode": self.encode, "impute": self.impute,
                "unknown_category": unknown, "feature_names": self.feature_names}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "TableEncoding":
        return cls(tuple(ColumnEncoding.from_dict(c) for c in config["columns"]), str(config["encode"]),
                   config.get("impute"))

    def encode_parsed(self, parsed: Mapping[str, Any]) -> np.ndarray:
        blocks = []
        for column in self.columns:
            values = parsed[column.name]
            if column.kind == "numeric":
                filled = values if column.fill is None else np.where(np.isnan(values), column.fill, values)
                blocks.append(((filled - column.mean) / column.std)[:, None])
                continue
            index = {category: i for i, category in enumerate(column.categories)}
            codes = np.array([index.get(value, UNKNOWN_CODE) for value in values], np.int64)
            if self.encode == "codes":
                blocks.append(codes[:, None].astype(np.float64))
            else:
                onehot = np.zeros((len(codes), len(column.categories)))
                known = np.flatnonzero(codes >= 0)
                onehot[known, codes[known]] = 1.0
                blocks.append(onehot)
        return np.concatenate(blocks, axis=1).astype(np.float32)

    def encode_rows(self, rows: Sequence[Mapping[str, str]], where: str = "rows") -> np.ndarray:
        """New rows ({column: cell text}) -> float32 [N, features_dim], with the same parsing and policy as packing
        (a bad cell is an ``InputError`` naming its row, counted from 1, and column)."""
        names = tuple(column.name for column in self.columns)
        cells = {name: tuple(str(row.get(name, "")).strip() for row in rows) for name in names}
        table = Table(where, "", names, tuple(range(1, len(rows) + 1)), cells)
        categorical = frozenset(c.name for c in self.columns if c.kind == "categorical")
        return self.encode_parsed(parse_inputs(table, names, categorical, self.impute is not None))


def fit_encoding(table: Table, parsed: Mapping[str, Any], layout: Layout, train: np.ndarray,
                 cfg: TableConfig) -> tuple[TableEncoding, list[dict[str, str]]]:
    """Fill values, means, stds and categories from the train rows only; columns with one value there are dropped
    (they carry nothing to learn, and their std would be 0), with a warning and a record."""
    columns, dropped = [], []
    for name in layout.inputs:
        values = parsed[name]
        if name in layout.categorical:
            seen = sorted({value for value, is_train in zip(values, train) if is_train and value is not None})
            if len(seen) >= 2:
                columns.append(ColumnEncoding(name, "categorical", categories=tuple(seen)))
            else:
                dropped.append(_drop(name, f"one category in the train split ({seen[0]!r})" if seen
                                     else "no values in the train split"))
            continue
        train_values = values[train]
        present = train_values[~np.isnan(train_values)]
        if not len(present):
            dropped.append(_drop(name, "no values in the train split"))
            continue
        fill = None if cfg.impute is None else _statistic(present, cfg.impute)
        filled = train_values if fill is None else np.where(np.isnan(train_values), fill, train_values)
        if filled.min() == filled.max():
            dropped.append(_drop(name, f"constant in the train split ({filled[0]:g})"))
            continue
        columns.append(ColumnEncoding(name, "numeric", float(filled.mean()), float(filled.std()), fill))
    if not columns:
        raise InputError("every input column is constant or empty in the train split; nothing to learn from",
                         path=table.path)
    return TableEncoding(tuple(columns), cfg.encode, cfg.impute), dropped


def _statistic(values: np.ndarray, name: str) -> float:
    return {"mean": lambda: float(values.mean()), "median": lambda: float(np.median(values)),
            "zero": lambda: 0.0}[name]()


def _drop(name: str, reason: str) -> dict[str, str]:
    log.warning("column %r dropped: %s", name, reason)
    return {"column": name, "reason": reason}


@dataclass(frozen=True)
class PreparedTable:
    """Everything to write, computed in memory before the output folder is touched (so bad input writes nothing)."""

    features: np.ndarray  # float32 [N, D], every row encoded
    target: Target
    keys: tuple[str, ...]
    splits: Mapping[str, np.ndarray]  # split name -> row indices in shard order
    config: Mapping[str, Any]
    config_hash: str
    source: Mapping[str, Any]


def prepare_table(cfg: TableConfig) -> PreparedTable:
    table = read_table(cfg.source)
    layout = resolve_columns(table, cfg)
    target = parse_target(table, cfg)
    split_of, fraction = assign_splits(table, layout, target, cfg)
    parsed = parse_inputs(table, layout.inputs, layout.categorical, cfg.impute is not None)
    train = split_of == "train"
    encoding, dropped = fit_encoding(table, parsed, layout, train, cfg)
    splits = {}
    for name in sorted(set(split_of.tolist()), key=split_order_key):
        rows = np.flatnonzero(split_of == name).tolist()
        if cfg.shuffle:  # mixed across shards, as image packing does; the seed makes it repeatable
            random.Random(f"{cfg.seed}/shuffle/{name}").shuffle(rows)
        splits[name] = np.array(rows, np.int64)
    target_info: dict[str, Any] = {"column": cfg.target, "task": target.task, "inferred": cfg.task == "auto"}
    if target.values is not None:
        target_info.update(mean=float(target.values[train].mean()), std=float(target.values[train].std()),
                           stored_as="targets")
    config = {"kind": TABLE_KIND, "source_sha256": table.sha256, "target": target_info,
              "split": {"column": layout.split_column, "val_fraction": fraction, "seed": cfg.seed,
                        "shuffle": cfg.shuffle},
              "dropped": dropped, "max_samples": cfg.max_samples, "dtype": FEATURE_DTYPE, "storage": cfg.storage,
              **encoding.to_config()}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    keys = tuple(f"row-{number:06d}" for number in table.row_numbers)
    source = {"kind": TABLE_KIND, "path": str(Path(cfg.source).resolve()), "rows": len(table),
              "header": list(table.header), "sha256": table.sha256}
    return PreparedTable(encoding.encode_parsed(parsed), target, keys, splits, config, digest.hexdigest()[:16],
                         source)


class TableResult(NamedTuple):
    manifest: FeatureManifest
    summary: dict[str, Any]


def pack_table(cfg: TableConfig) -> TableResult:
    """Read, check and encode the whole table, then write the shards and ``features.json`` (last) under the
    folder's writer lock. A folder already holding this exact output is left untouched."""
    started = time.monotonic()
    prepared = prepare_table(cfg)
    out = Path(cfg.out)
    check_table_output(out, prepared.config_hash, cfg.overwrite)  # refuse before creating even a lock file
    with claim_output(out, STATE_DIR, what="pack-shards --table", exclusive=True,
                      prepare=lambda _lock: _clear_if_needed(out, prepared.config_hash, cfg.overwrite)):
        manifest = _finished(out, prepared.config_hash)
        unchanged = manifest is not None
        if manifest is None:
            manifest = _write(out, prepared, cfg)
    log.info("%s %s/%s", "kept the identical" if unchanged else "wrote", out, FEATURES_FILE)
    summary = {"out": str(cfg.out), "task": prepared.target.task, "features": manifest.features_dim,
               "classes": list(manifest.classes), "rows": {n: s.samples for n, s in manifest.splits.items()},
               "shards": sum(len(s.shards) for s in manifest.splits.values()),
               "dropped": [d["column"] for d in prepared.config["dropped"]], "unchanged": unchanged,
               "seconds": round(time.monotonic() - started, 3)}
    return TableResult(manifest, summary)


def _is_own_file(name: str) -> bool:
    name = tmp_target(name) or name
    return is_feature_file(name) or name == FEATURES_FILE


def _existing_hash(out: Path) -> str | None:
    """The config hash of the table features in ``out``; "" for a features.json of anything else; None: none."""
    if not (out / FEATURES_FILE).is_file():
        return None
    try:
        manifest = load_feature_manifest(out)
    except ShardcacheError:
        return ""
    return manifest.config_hash if manifest.config.get("kind") == TABLE_KIND else ""


def check_table_output(out: Path, digest: str, overwrite: bool) -> bool:
    """Refuse a folder holding other output unless ``overwrite`` (writes nothing); True when our own files there
    (another table's, or an unfinished run's) must be removed first. Files shardcache did not write always stay,
    and a folder of image shards is always refused: one folder, one manifest."""
    if out.exists() and not out.is_dir():
        raise OutputExistsError("is a file, not a folder", path=str(out))
    if not out.is_dir():
        return False
    if (out / DATASET_FILE).exists():
        raise OutputExistsError("holds image shards (dataset.json); pack the table into a folder of its own",
                                path=str(out))
    entries = [p.name for p in out.iterdir() if p.name != STATE_DIR]
    existing = _existing_hash(out)
    if existing == digest or not entries:
        return False
    if existing is None and all(_is_own_file(name) for name in entries):
        return True  # shards of a run killed before its features.json: nothing finished to protect
    if not overwrite:
        what = ("holds other features" if existing is not None
                else "is not empty and holds no shardcache features")
        raise OutputExistsError(f"{what}; pass --overwrite to replace them (only shardcache's own files are "
                                "removed)", path=str(out))
    return True


def _clear_if_needed(out: Path, digest: str, overwrite: bool) -> None:
    if check_table_output(out, digest, overwrite):
        if _existing_hash(out) is not None:
            log.warning("--overwrite: replacing the features in %s", out)
        for entry in out.iterdir():
            if entry.is_file() and _is_own_file(entry.name):
                entry.unlink()


def _finished(out: Path, digest: str) -> FeatureManifest | None:
    """This exact output, already complete and intact in ``out`` (every shard's size and sha256 as recorded)."""
    if _existing_hash(out) != digest:
        return None
    manifest = load_feature_manifest(out)
    for split in manifest.splits.values():
        for info in split.shards:
            path = out / info.path
            if not path.is_file() or path.stat().st_size != info.bytes or sha256_file(path) != info.sha256:
                return None
    return manifest


def _write(out: Path, prepared: PreparedTable, cfg: TableConfig) -> FeatureManifest:
    # Imported here: the pack-shards CLI imports this module, and ``pack-shards --help`` stays free of torch.
    import torch

    from shards.formats.features import FeatureShard, feature_shard_name, write_feature_shard

    target = prepared.target
    names = {name: [feature_shard_name(f"{name}-{i:06d}", cfg.storage)
                    for i in range(math.ceil(len(rows) / cfg.max_samples))] for name, rows in prepared.splits.items()}
    remove_stale_tmp(out, {n for shard_names in names.values() for n in shard_names} | {FEATURES_FILE})
    splits = {}
    for name, rows in prepared.splits.items():
        infos = []
        for shard_name, start in zip(names[name], range(0, len(rows), cfg.max_samples)):
            chunk = rows[start:start + cfg.max_samples]
            # Fancy indexing copies: a slice would share (and torch.save would store) the whole split's array.
            targets = None if target.values is None else torch.from_numpy(target.values[chunk].astype(np.float32))
            shard = FeatureShard(torch.from_numpy(prepared.features[chunk]), torch.from_numpy(target.labels[chunk]),
                                 [prepared.keys[r] for r in chunk], targets=targets)
            size, digest = write_feature_shard(out / shard_name, shard, cfg.storage)
            # Per-shard class counts let a class subset skip shards unread; a regression table has no classes.
            shard_counts = (tuple(int(c) for c in np.bincount(target.labels[chunk], minlength=len(target.classes)))
                            if target.classes else None)
            infos.append(ShardInfo(shard_name, len(chunk), size, digest, class_counts=shard_counts))
        counts = np.bincount(target.labels[rows], minlength=len(target.classes)) if target.classes else []
        splits[name] = SplitInfo(len(rows), tuple(int(c) for c in counts), tuple(infos))
    manifest = FeatureManifest(storage=cfg.storage, classes=target.classes, splits=splits,
                               features_dim=prepared.features.shape[1], dtype=FEATURE_DTYPE, views=0,
                               config=dict(prepared.config), config_hash=prepared.config_hash,
                               # The folder is its own dataset: there is no dataset.json behind it.
                               dataset_dir=".", dataset_sha256=prepared.source["sha256"],
                               extra={"source": dict(prepared.source)})
    manifest.save(out)
    return manifest

