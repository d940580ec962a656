"""What a feature folder's files are called and what its rows are for: plain names and rules, no torch.

``pack-shards`` (tables, ``--out s3://`` publishing) needs them to tell its own files from a user's, and must start
without importing torch; ``shards.formats.features`` (the files themselves) re-exports them.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from shards.errors import ManifestError
from shards.door.shape import as_number

FEATURE_SUFFIXES = {"pt": ".pt", "hdf5": ".h5"}
TABLE_KIND = "table"  # ``config.kind`` of a feature folder packed from a CSV (``pack-shards --table``)


def from_table(config: Mapping[str, Any]) -> bool:
    """Whether a feature folder was packed from a table: then no ``dataset.json`` stands behind it, and there is
    nothing for it to be stale against."""
    return config.get("kind") == TABLE_KIND


def is_feature_file(name: str) -> bool:
    """Whether a file name is one shardcache writes for a feature shard (``<split>-NNNNNN.pt|.h5``): what an
    ``--overwrite`` or an upload may treat as its own."""
    return bool(_FEATURE_FILE.match(name))


_FEATURE_FILE = re.compile(r"^[A-Za-z0-9_]+-\d{6}\.(pt|h5)\Z")


def check_target(config: Mapping[str, Any], where: str | None = None) -> None:
    """A regression target's recorded statistics are finite, its std positive: training divides by the std and
    adds the mean back to every prediction, so a ``NaN``, ``"1"`` or ``0`` there would train on nonsense silently.
    A ``ManifestError`` naming ``config.target.<field>`` otherwise; nothing to check for a classification folder."""
    if target_task(config) != "regression":
        return
    target = config["target"]
    as_number(target.get("mean"), "config.target.mean", where=where)
    std = as_number(target.get("std"), "config.target.std", where=where)
    if not std > 0:
        raise ManifestError(f"config.target.std is {std!r}: expected a number above 0", path=where)


def target_task(config: Mapping[str, Any]) -> str:
    """What a feature folder's rows are for, from its ``features.json`` config: "regression" when every shard
    promises a float target per row (a table packed with a regression target, ``config.target``), else
    "classification" (the labels are what to predict)."""
    target = config.get("target")
    if isinstance(target, Mapping) and target.get("task") == "regression" and target.get("stored_as") == "targets":
        return "regression"
    return "classification"
