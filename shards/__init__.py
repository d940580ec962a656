"""shardcache's on-disk contract and streaming reader: manifests, shard formats, decoding, the IterableDataset.

The package exports what a newcomer's code calls: ``open_dataset`` and the option records a call passes,
``make_loader`` and its collate, the mixture's sources. Everything else (the dataset classes, the epoch plan,
decoders, transforms' builders) is imported from its own module. The names are imported lazily, so
``import shards.manifest`` (and the CLIs) stay light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "open_dataset": "shards.stream.reader",
    "make_loader": "shards.loader.loader",
    "pad_collate": "shards.loader.loader",
    "WorkerProcesses": "shards.loader.worker_processes",
    "InProcess": "shards.loader.in_process",
    "Threads": "shards.loader.threads",
    "Auto": "shards.loader.auto",
    "StallPolicy": "shards.loader.watchdog",
    "Sampling": "shards.stream.options",
    "ErrorPolicy": "shards.stream.options",
    "Decode": "shards.stream.options",
    "Remote": "shards.stream.options",
    "ShardCache": "shards.cache.node",
    "Distributed": "shards.stream.options",
    "MemoryCache": "shards.stream.options",
    "TransformSpec": "shards.image.transforms",
    "SourceSpec": "shards.select.mixture",
    "Subset": "shards.select.mixture",
    "MixOptions": "shards.select.mixture",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shards' has no attribute {name!r}")
