"""Give a test's image dataset (written by the shard writers, without a packer) the column index ``pack-shards``
writes, so class weighting has its labels: keys and labels read from the shards in manifest order."""

from __future__ import annotations

from pathlib import Path

import shards
from shards.formats.column_writer import write_split_columns
from shards.formats.columns import COLUMNS_KEY, FORMAT
from shards.manifest import DatasetManifest, load_dataset_manifest


def add_label_columns(folder: Path) -> DatasetManifest:
    """Write ``folder``'s columns (``key`` and ``label``) for every split and record them in its ``dataset.json``."""
    manifest = load_dataset_manifest(folder)
    entries = {}
    for split, info in manifest.splits.items():
        plain = shards.open_dataset(folder, split, return_keys=True, sampling=shards.Sampling(shuffle=False),
                                    decode=shards.Decode(decoder=lambda sample, seed: 0))
        rows = [{"key": key, "label": int(label)} for _, label, key in plain]
        entries[split] = write_split_columns(folder, split, lambda: iter(rows), info.samples)
    manifest = manifest.replace(extra={**manifest.extra, COLUMNS_KEY: {"format": FORMAT, "splits": entries}})
    manifest.save(folder)
    return manifest
