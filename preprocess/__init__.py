"""shardcache preprocess package: the jobs before training, each a Python call beside its command.

``pack_shards`` (``pack-shards``) and ``precompute_features`` (``precompute-features``) take the commands'
options as keywords. They are imported lazily, so ``import preprocess.pack.cli`` (and ``--help``) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"pack_shards": "preprocess.pack.api", "precompute_features": "preprocess.features.api"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'preprocess' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
