"""What gets trained: a linear or MLP head over cached features, or a torchvision model over images.

Pretrained weights come only from a local file the user names, loaded with ``weights_only=True`` (never unpickled,
never downloaded); layers whose shape does not fit the new class count (the classifier) start fresh.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torchvision
from torch import nn

from shards.errors import InputError, MissingInputError

log = logging.getLogger("shardcache.train")


def build_head(kind: str, features_dim: int, num_classes: int, *, hidden_dim: int = 512,
               dropout: float = 0.0) -> nn.Module:
    """A linear probe, or one hidden layer for features that are not linearly separable."""
    if kind == "linear":
        return nn.Linear(features_dim, num_classes)
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(features_dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, num_classes),
        )
    raise InputError(f"unknown head {kind!r}; choose linear or mlp")


def image_model_names() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


def check_image_model(name: str, weights: str | os.PathLike | None = None) -> None:
    """Fail on a bad model name or weights path before any data is read or process started."""
    names = image_model_names()
    if name not in names:
        raise InputError(f"unknown model {name!r}; torchvision classification models are: {', '.join(names)}")
    if weights is not None and not Path(weights).is_file():
        raise MissingInputError("weights file not found", path=str(weights))


def build_image_model(name: str, num_classes: int, *, weights: str | os.PathLike | None = None) -> nn.Module:
    """A torchvision classification model by name, randomly initialised or from a local weights file."""
    check_image_model(name, weights)
    extra: dict[str, Any] = {}
    if name in ("googlenet", "inception_v3"):
        extra = {"aux_logits": False, "init_weights": True}
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes, **extra)
    if weights is not None:
        load_matching_weights(model, weights)
    return model


def _unwrap_state_dict(obj: Any, path: str) -> Mapping[str, torch.Tensor]:
    """Accept a bare state dict or the usual wrappers (``model.pt`` of a run, ``{"state_dict": ...}``)."""
    for key in ("state_dict", "model"):
        if isinstance(obj, Mapping) and isinstance(obj.get(key), Mapping):
            obj = obj[key]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InputError("not a state dict of tensors", path=path)
    # DistributedDataParallel saves "module."-prefixed names.
    return {k.removeprefix("module."): v for k, v in obj.items()}


def load_matching_weights(model: nn.Module, weights: str | os.PathLike) -> None:
    """Load every tensor whose name and shape match; the classifier for a different class count starts fresh."""
    path = str(weights)
    if not Path(path).is_file():
        raise MissingInputError("weights file not found", path=path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a damaged or pickled-object file
        raise InputError(f"cannot load weights with weights_only=True ({type(exc).__name__}: {exc})",
                         path=path) from exc
    state = _unwrap_state_dict(loaded, path)
    own = model.state_dict()
    fitting = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    reshaped = sorted(k for k in state if k in own and own[k].shape != state[k].shape)
    missing = sorted(k for k in own if k not in fitting and k not in reshaped)
    if missing:
        raise InputError(f"weights do not fit the model: {len(missing)} tensors missing, e.g. {missing[:3]}",
                         path=path)
    model.load_state_dict(fitting, strict=False)
    log.info("loaded %d tensors from %s; starting fresh: %s", len(fitting), path, ", ".join(reshaped) or "none")


def logits_of(output: Any) -> torch.Tensor:
    """Models with auxiliary outputs return a named tuple; the loss wants the main logits."""
    return output if isinstance(output, torch.Tensor) else output.logits


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
