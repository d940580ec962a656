"""Run configs for tests: a test names only the fields its behaviour depends on, by their name in their group.

``train_config(data, out, epochs=2, workers=0)`` is ``TrainConfig.of(data, out, {"optim.epochs": 2,
"loader.workers": 0})``: a field's name is unique across the groups (checked below), so the short form says the
same and keeps a test about, say, resuming readable as the few settings it changes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from train.config import GROUPS, TrainConfig

FIELD_PATHS = {f.name: f"{group}.{f.name}" for group, kind in GROUPS.items() for f in dataclasses.fields(kind)}
assert len(FIELD_PATHS) == sum(len(dataclasses.fields(kind)) for kind in GROUPS.values()), "a field name repeats"


def train_config(data: str | Path, out: str | Path, **fields: Any) -> TrainConfig:
    """A run of ``data`` into ``out`` with ``fields`` (each by its name in its group) changed from the defaults."""
    return TrainConfig.of(str(data), str(out), paths(**fields))


def paths(**fields: Any) -> dict[str, Any]:
    """``fields`` by their dotted paths, as ``TrainConfig.replace`` and ``differences`` name them."""
    unknown = sorted(set(fields) - set(FIELD_PATHS))
    assert not unknown, f"not a TrainConfig field: {unknown}"
    return {FIELD_PATHS[name]: value for name, value in fields.items()}
