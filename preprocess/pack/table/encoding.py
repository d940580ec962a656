"""The fitted encoding of ``pack-shards --table``: how each input column becomes float32 features.

``fit_encoding`` learns means, standard deviations, fill values and categories from the train split only (so
nothing about val leaks into the inputs) and drops the columns that carry nothing to learn. ``TableEncoding`` is
that recipe as data: it round-trips through ``features.json``'s ``config`` (``to_config`` / ``from_config``), so
rows seen later (val, or new rows to predict from ``model.pt``) are encoded exactly as the training rows were.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from preprocess.pack.table.config import TableConfig
from preprocess.pack.table.read import FLOAT32_MAX, UNKNOWN_CODE, Layout, Table, finite_moments, parse_inputs
from shards.errors import InputError

log = logging.getLogger("shardcache.pack")


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

    def encode_parsed(self, table: Table, parsed: Mapping[str, Any]) -> np.ndarray:
        """``table``'s cells as ``parse_inputs`` parsed them -> float32 [N, features_dim]; a number that lands
        beyond float32 once scaled is an ``InputError`` naming its row and column, never an inf in the features."""
        blocks = []
        for column in self.columns:
            values = parsed[column.name]
            if column.kind == "numeric":
                filled = values if column.fill is None else np.where(np.isnan(values), column.fill, values)
                with np.errstate(over="ignore", invalid="ignore"):
                    scaled = (filled - column.mean) / column.std
                    bad = np.flatnonzero(~(np.abs(scaled) <= FLOAT32_MAX))
                if len(bad):
                    raise table.error(int(bad[0]), column.name, f"{filled[bad[0]]:g} is too far from the train "
                                      f"split's mean ({column.mean:g}, standard deviation {column.std:g}) to store "
                                      "as float32 once standardised")
                blocks.append(scaled[:, None])
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
        return self.encode_parsed(table, parse_inputs(table, names, categorical, self.impute is not None))


def fit_encoding(table: Table, parsed: Mapping[str, Any], layout: Layout, train: np.ndarray,
                 cfg: TableConfig) -> tuple[TableEncoding, list[dict[str, str]]]:
    """Fill values, means, stds and categories from the train rows only; columns with one value there are dropped
    (they carry nothing to learn, and their std would be 0), with a warning and a record."""
    columns, dropped = [], []
    train_rows = np.flatnonzero(train)
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
        known = ~np.isnan(train_values)
        present = train_values[known]
        if not len(present):
            dropped.append(_drop(name, "no values in the train split"))
            continue
        if cfg.impute == "mean":  # the fill is this mean: it must be finite before it fills a cell
            finite_moments(table, name, present, train_rows[known])
        fill = None if cfg.impute is None else _statistic(present, cfg.impute)
        filled = train_values if fill is None else np.where(known, train_values, fill)
        if filled.min() == filled.max():
            dropped.append(_drop(name, f"constant in the train split ({filled[0]:g})"))
            continue
        mean, std = finite_moments(table, name, filled, train_rows)
        columns.append(ColumnEncoding(name, "numeric", mean, std, fill))
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
