"""Tables packed straight into feature shards: ``pack-shards table.csv --table --target COLUMN --out DIR``.

A table's columns already are features, so there is no image stage: its rows become float32 feature shards and a
``features.json`` in the format ``precompute-features`` writes, which ``shards.open_dataset`` and
``train-from-shards`` read unchanged. Everything that turned cells into numbers (the train split's means and
standard deviations, imputed values, categories, dropped columns) is recorded in ``features.json``'s ``config`` and
applied by ``TableEncoding``, so new rows are encoded exactly as the training rows were (``train-from-shards``
copies that config into ``model.pt``).

Bad cells are input errors, not guesses: a missing or non-numeric cell stops the job (exit 2, nothing written),
naming the file, the spreadsheet row (the header is row 1) and the column, unless ``--impute`` asks for missing
cells to be filled. So is a number whose standardisation would overflow (cells near 1e308 or 1e154 make the mean or
std inf, and every value NaN) or land beyond float32, and a regression target beyond float32; an ``inf`` among
numeric targets is refused, never taken to make every value a class name. Statistics come from the train split
only, so nothing about val leaks into the inputs. A regression target is stored as the feature format's
``targets`` (float32 [N]) beside all-zero placeholder labels, and ``config.target`` records its train mean and std
(``train-from-shards --task regression`` standardises with them).

The output folder is never mixed: without ``--overwrite`` a folder holding anything but this table's own output
(finished, or cut short by a killed run, which is resumed) is refused, and nothing in it is deleted or replaced;
``--overwrite`` deletes only the files the old output names (its ``features.json`` and the records in ``.pack/``,
``shards.jobs.owned``), never a user's file that merely looks like a shard, and refuses to write over one.

The work is split by concern: ``preprocess.pack.table.read`` reads and checks the cells, columns, target and
splits; ``preprocess.pack.table.encoding`` fits and applies the encoding; ``preprocess.pack.table.config`` holds
the options (``TableConfig``), which both of those read; this module holds the orchestration and the writing.
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

from preprocess.pack import parts
from preprocess.pack.parts import STATE_DIR
from preprocess.pack.plan import split_order_key
from preprocess.pack.table.config import TableConfig
from preprocess.pack.table.encoding import fit_encoding
from preprocess.pack.table.read import Target, assign_splits, parse_inputs, parse_target, read_table, resolve_columns
from shards.atomic import remove_stale_tmp, sha256_file, write_json_atomic
from shards.door.bounded_read import read_json_file
from shards.errors import InputError, OutputExistsError, ShardcacheError
from shards.lock import claim_output
from shards.manifest import (DATASET_FILE, FEATURES_FILE, FeatureManifest, ShardInfo, SplitInfo,
                             load_feature_manifest)
from shards.formats.feature_names import TABLE_KIND, from_table
from shards.jobs.owned import manifest_names, plain_names, refuse_clobber, remove_owned

log = logging.getLogger("shardcache.pack")

FEATURE_DTYPE = "float32"


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
    return PreparedTable(encoding.encode_parsed(table, parsed), target, keys, splits, config, digest.hexdigest()[:16],
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
    names = shard_names(prepared, cfg)
    writes = {name for split in names.values() for name in split} | {FEATURES_FILE}
    # Refused before creating even a lock file; checked again under the lock (another run may have written since).
    check_table_output(out, prepared.config_hash, writes, cfg.overwrite)
    with claim_output(out, STATE_DIR, what="pack-shards --table", exclusive=True,
                      prepare=lambda _lock: _clear_if_needed(out, prepared.config_hash, writes, cfg.overwrite)):
        manifest = _finished(out, prepared.config_hash)
        unchanged = manifest is not None
        if manifest is None:
            manifest = _write(out, prepared, cfg, names)
    log.info("%s %s/%s", "kept the identical" if unchanged else "wrote", out, FEATURES_FILE)
    summary = {"out": str(cfg.out), "task": prepared.target.task, "features": manifest.features_dim,
               "classes": list(manifest.classes), "rows": {n: s.samples for n, s in manifest.splits.items()},
               "shards": sum(len(s.shards) for s in manifest.splits.values()),
               "dropped": [d["column"] for d in prepared.config["dropped"]], "unchanged": unchanged,
               "seconds": round(time.monotonic() - started, 3)}
    return TableResult(manifest, summary)


def shard_names(prepared: PreparedTable, cfg: TableConfig) -> dict[str, list[str]]:
    """Each split's feature shard names in order (``train-000000.pt``...), one per ``max_samples`` rows."""
    from shards.formats.features import feature_shard_name  # torch: see ``_write``

    return {name: [feature_shard_name(f"{name}-{i:06d}", cfg.storage)
                   for i in range(math.ceil(len(rows) / cfg.max_samples))] for name, rows in prepared.splits.items()}


def _table_records(out: Path) -> list[Any]:
    """The config hash each record in ``OUT/.pack/`` carries (None for a record that is not a table's: an image
    packing plan or part manifest, or an unreadable file)."""
    state = out / STATE_DIR
    hashes: list[Any] = []
    for path in sorted(state.glob("*.json")) if state.is_dir() and not state.is_symlink() else ():
        try:
            record = read_json_file(path)
        except (OSError, ValueError):
            record = None
        hashes.append(record.get("config_hash") if isinstance(record, dict) and record.get("kind") == TABLE_KIND
                      else None)
    return hashes


def recorded_names(out: Path) -> set[str]:
    """The files at the top of OUT that what is there names as its own, and so all that ``--overwrite`` may
    delete (``shards.jobs.owned``): ``features.json`` and the shards it lists, and what the records in ``.pack/`` name
    (``parts.recorded_names``: one ``<file>.json`` per file a table run writes, written before that file, so a
    killed run's shards are named too; an unfinished image packing's plan and parts). Nothing else is ours."""
    names: list[Any] = list(parts.recorded_names(out))
    names += manifest_names(out, FEATURES_FILE, load_feature_manifest,
                            lambda manifest: [info.path for split in manifest.splits.values() for info in split.shards])
    return plain_names(names)


def _existing_hash(out: Path) -> str | None:
    """The config hash of the table output in ``out``: its ``features.json``'s, else that of the records a killed
    run left in ``.pack/``; "" for anything else of ours (other features, an image packing); None: nothing."""
    if (out / FEATURES_FILE).is_file():
        try:
            manifest = load_feature_manifest(out)
        except ShardcacheError:
            return ""
        return manifest.config_hash if from_table(manifest.config) else ""
    hashes = set(_table_records(out))
    if not hashes:
        return None
    only = hashes.pop() if len(hashes) == 1 else None
    return only if isinstance(only, str) and only else ""


def check_table_output(out: Path, digest: str, writes: set[str], overwrite: bool) -> bool:
    """Refuse a folder holding other output unless ``overwrite`` (writes nothing); True when the old output's own
    files must be removed first. This config's output, finished or cut short by a killed run, is resumed.

    A file of the user's is never deleted or replaced: only what the old output names is removed
    (``recorded_names``), and a file this run would write that nothing there names is refused even with
    ``overwrite`` (``shards.jobs.owned.refuse_clobber``). A folder of image shards is always refused: one folder, one
    manifest."""
    if out.exists() and not out.is_dir():
        raise OutputExistsError("is a file, not a folder", path=str(out))
    if not out.is_dir():
        return False
    if (out / DATASET_FILE).exists():
        raise OutputExistsError("holds image shards (dataset.json); pack the table into a folder of its own",
                                path=str(out))
    existing = _existing_hash(out)
    entries = [p.name for p in out.iterdir() if p.name != STATE_DIR]
    conflict = existing != digest and (existing is not None or bool(entries))
    if conflict and not overwrite:
        what = ("holds other features" if existing is not None
                else "is not empty and holds no shardcache features")
        raise OutputExistsError(f"{what}; pass --overwrite to replace them (only the files the old output names "
                                "are removed)", path=str(out))
    refuse_clobber(out, recorded_names(out), writes, writer="pack-shards --table")
    return conflict


def _clear_if_needed(out: Path, digest: str, writes: set[str], overwrite: bool) -> None:
    if check_table_output(out, digest, writes, overwrite):
        if _existing_hash(out) is not None:
            log.warning("--overwrite: replacing the features in %s", out)
        remove_owned(out, recorded_names(out), STATE_DIR)


def _finished(out: Path, digest: str) -> FeatureManifest | None:
    """This exact output, already complete and intact in ``out`` (every shard's size and sha256 as recorded)."""
    if not (out / FEATURES_FILE).is_file() or _existing_hash(out) != digest:
        return None
    manifest = load_feature_manifest(out)
    for split in manifest.splits.values():
        for info in split.shards:
            path = out / info.path
            if not path.is_file() or path.stat().st_size != info.bytes or sha256_file(path) != info.sha256:
                return None
    return manifest


def _write(out: Path, prepared: PreparedTable, cfg: TableConfig, names: Mapping[str, list[str]]) -> FeatureManifest:
    # Imported here: the pack-shards CLI imports this module, and ``pack-shards --help`` stays free of torch.
    import torch

    from shards.formats.features import FeatureShard, write_feature_shard

    target = prepared.target
    files = [name for split in names.values() for name in split]
    # Every file is recorded as this run's before any is written: a run killed midway leaves only named files,
    # which the next run resumes (same config) or ``--overwrite`` removes, and never a lookalike of the user's.
    for name in files:
        write_json_atomic(out / STATE_DIR / f"{name}.json", {"kind": TABLE_KIND, "config_hash": prepared.config_hash})
    remove_stale_tmp(out, {*files, FEATURES_FILE})
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

