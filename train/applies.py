"""Options that do not apply to what PATH holds are refused, not ignored.

What a folder holds (image shards or cached features) is known only from its manifest, so ``train-from-shards``
cannot refuse ``--model`` on a feature folder while parsing: ``prepare_manifest`` calls ``check_options_apply``
before any process group or run folder exists. An option counts as given when it differs from its default (the
same test serves ``train.train_from_shards`` and a config file); the line names each option, its value and why.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from shards.errors import InputError
from train.config import TrainConfig
from train.options import CacheOptions, LoaderOptions, ModelOptions

# (group, field, option, kind it applies to): image-model options on features, feature-head options on images.
_ONLY_FOR = (
    ("model", "name", "--model", "images"),
    ("model", "weights", "--weights", "images"),
    ("loader", "image_size", "--image-size", "images"),
    ("loader", "fast_decode", "--fast-decode", "images"),
    ("cache", "images", "--cache-images", "images"),
    ("model", "head", "--head", "features"),
    ("model", "hidden_dim", "--hidden-dim", "features"),
    ("model", "dropout", "--dropout", "features"),
    ("model", "logreg_c", "--logreg-c", "features"),
    ("loader", "feature_window", "--feature-window", "features"),
)
_GROUPS = {"model": ModelOptions, "loader": LoaderOptions, "cache": CacheOptions}
_HOLDS = {"images": "image shards (dataset.json)", "features": "cached features (features.json)"}


def _default(group: str, name: str) -> Any:
    field = next(f for f in dataclasses.fields(_GROUPS[group]) if f.name == name)
    return field.default


def check_options_apply(cfg: TrainConfig, kind: str, path: str) -> None:
    """An ``InputError`` naming every option given that applies only to the other kind of input than ``kind``."""
    wrong = []
    for group, name, option, applies_to in _ONLY_FOR:
        value = getattr(getattr(cfg, group), name)
        if applies_to != kind and value != _default(group, name):
            wrong.append(option if value is True else f"{option} {value}")
    if cfg.model.standardize and kind == "images" and cfg.model.head != "logreg":  # logreg's own default
        wrong.append("--standardize")
    if wrong:
        other = "features" if kind == "images" else "images"
        raise InputError(f"{', '.join(wrong)} {'applies' if len(wrong) == 1 else 'apply'} to {_HOLDS[other]}, "
                         f"but the folder holds {_HOLDS[kind]}: leave {'it' if len(wrong) == 1 else 'them'} out",
                         path=path)
