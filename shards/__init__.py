"""shardcache's on-disk contract and streaming reader: manifests, shard formats, decoding, the IterableDataset.

The reader's public names are imported lazily, so ``import shards.manifest`` (and the CLIs) stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "open_dataset": "shards.stream.reader",
    "make_loader": "shards.stream.loader",
    "pad_collate": "shards.stream.loader",
    "ShardLoader": "shards.stream.loader",
    "FeatureBatchLoader": "shards.stream.feature_loader",
    "ShardDataset": "shards.stream.dataset",
    "ImageShardDataset": "shards.stream.image_dataset",
    "FeatureShardDataset": "shards.stream.feature_stream",
    "StreamConfig": "shards.stream.dataset",
    "Sampling": "shards.stream.options",
    "ErrorPolicy": "shards.stream.options",
    "Decode": "shards.stream.options",
    "Remote": "shards.stream.options",
    "Distributed": "shards.stream.options",
    "MemoryCache": "shards.stream.options",
    "ShardCache": "shards.cache.node",
    "SourceSpec": "shards.stream.mixture",
    "Subset": "shards.stream.mixture",
    "MixOptions": "shards.stream.mixture",
    "ImageDecoder": "shards.image.decode",
    "TransformSpec": "shards.image.transforms",
    "build_transform": "shards.image.transforms",
    "train_transform": "shards.image.transforms",
    "eval_transform": "shards.image.transforms",
    "plan_epoch": "shards.stream.plan",
    "Normalize": "shards.image.device",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shards' has no attribute {name!r}")
