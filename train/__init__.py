"""shardcache train package: ``train_from_shards`` is ``train-from-shards`` as a Python call (its options as
keywords); ``train_config`` builds the same ``TrainConfig`` the command does. Imported lazily, so the command's
``--help`` loads no torch."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"train_from_shards": "train.api", "train_config": "train.api"}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'train' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
