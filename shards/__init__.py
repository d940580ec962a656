"""shardcache's on-disk contract and streaming reader: manifests, shard formats, decoding, the IterableDataset.

The reader's public names are imported lazily, so ``import shards.manifest`` (and the CLIs) stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "open_dataset": "shards.reader",
    "make_loader": "shards.loader",
    "pad_collate": "shards.loader",
    "ShardLoader": "shards.loader",
    "FeatureBatchLoader": "shards.feature_stream",
    "ShardDataset": "shards.dataset",
    "ImageShardDataset": "shards.dataset",
    "FeatureShardDataset": "shards.feature_stream",
    "StreamConfig": "shards.dataset",
    "ImageDecoder": "shards.decode",
    "TransformSpec": "shards.transforms",
    "build_transform": "shards.transforms",
    "train_transform": "shards.transforms",
    "eval_transform": "shards.transforms",
    "plan_epoch": "shards.plan",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shards' has no attribute {name!r}")
