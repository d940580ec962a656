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

The work is split by concern: ``preprocess.pack.table_read`` reads and checks the cells, columns, target and
splits; ``preprocess.pack.table_encoding`` fits and applies the encoding; this module holds the config, the
orchestration and the writing, and re-exports the public names of the other two.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import numpy as np

from preprocess.pack.parts import STATE_DIR
from preprocess.pack.plan import split_order_key
from preprocess.pack.table_encoding import ColumnEncoding, TableEncoding, fit_encoding
from preprocess.pack.table_read import (DEFAULT_VAL_FRACTION, MAX_INFERRED_CLASSES, MISSING_CELLS, SPLIT_COLUMN,
                                        UNKNOWN_CODE, Layout, Table, Target, assign_splits, parse_inputs,
                                        parse_target, read_table, resolve_columns)
from shards.atomic import check_local_output, remove_stale_tmp, sha256_file, tmp_target
from shards.errors import InputError, OutputExistsError, ShardcacheError
from shards.lock import claim_output
from shards.manifest import (DATASET_FILE, FEATURES_FILE, FeatureManifest, ShardInfo, SplitInfo,
                             load_feature_manifest)
from shards.formats.feature_names import TABLE_KIND, from_table, is_feature_file

# This module's public names and those it re-exports from table_read and table_encoding: callers import from here.
__all__ = ["DEFAULT_VAL_FRACTION", "ENCODINGS", "FEATURE_DTYPE", "IMPUTE_STATISTICS", "MAX_INFERRED_CLASSES",
           "MISSING_CELLS", "SPLIT_COLUMN", "TABLE_KIND", "TABLE_STORAGES", "TASKS", "UNKNOWN_CODE", "ColumnEncoding",
           "Layout", "PreparedTable", "Table", "TableConfig", "TableEncoding", "TableResult", "Target",
           "assign_splits", "check_table_output", "fit_encoding", "pack_table", "parse_inputs", "parse_target",
           "prepare_table", "read_table", "resolve_columns"]

log = logging.getLogger("shardcache.pack")

TASKS = ("auto", "classification", "regression")
ENCODINGS = ("onehot", "codes")
IMPUTE_STATISTICS = ("mean", "median", "zero")
TABLE_STORAGES = ("pt", "hdf5")
FEATURE_DTYPE = "float32"


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
        std = float(target.values[train].std())
        if not std > 0:  # the statistics come from train: a target constant there cannot be standardised
            raise InputError(f"target {cfg.target!r} is {target.values[train][0]:g} in every train row; nothing to "
                             "learn", path=table.path)
        target_info.update(mean=float(target.values[train].mean()), std=std, stored_as="targets")
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
    return manifest.config_hash if from_table(manifest.config) else ""


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

