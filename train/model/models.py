"""What gets trained: a linear or MLP head over cached features, or a torchvision model over images.

Pretrained weights come only from a local file the user names, loaded with ``weights_only=True`` (never unpickled,
never downloaded); layers whose shape does not fit the new class count (the classifier) start fresh.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from shards.errors import InputError, MissingInputError
from shards.suggest import did_you_mean
from shards.formats.weights import read_state_dict
from train.model.standardize import FeatureScale, StandardizedHead

log = logging.getLogger("shardcache.train")


def build_head(kind: str, features_dim: int, num_classes: int, *, hidden_dim: int = 512,
               dropout: float = 0.0, scale: FeatureScale | None = None) -> nn.Module:
    """A linear probe (``logreg``: the same layer, fitted by ``train.model.probe``), or one hidden layer for features
    that are not linearly separable; behind ``Standardize`` when given the train split's ``scale``."""
    if kind in ("linear", "logreg"):
        head: nn.Module = nn.Linear(features_dim, num_classes)
    elif kind == "mlp":
        head = nn.Sequential(
            nn.Linear(features_dim, hidden_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, num_classes),
        )
    else:
        raise InputError(f"unknown head {kind!r}; choose linear, mlp or logreg")
    return head if scale is None else StandardizedHead(scale, head)


def image_model_names() -> list[str]:
    return sorted(torchvision.models.list_models(module=torchvision.models))


def check_image_model(name: str, weights: str | os.PathLike | None = None) -> None:
    """Fail on a bad model name or weights path before any data is read or process started."""
    names = image_model_names()
    if name not in names:
        raise InputError(f"unknown model {name!r}" + did_you_mean(
            name, names, more="; torchvision classification models include resnet18, resnet50, efficientnet_b0, "
                              "vit_b_16, ..."))
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


def load_matching_weights(model: nn.Module, weights: str | os.PathLike) -> None:
    """Load every tensor whose name and shape match; the classifier for a different class count starts fresh."""
    path = str(weights)
    state = read_state_dict(path)
    own = model.state_dict()
    fitting = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    reshaped = sorted(k for k in state if k in own and own[k].shape != state[k].shape)
    missing = sorted(k for k in own if k not in fitting and k not in reshaped)
    if missing:
        raise InputError(f"weights do not fit the model: {len(missing)} tensors missing, e.g. {missing[:3]}",
                         path=path)
    model.load_state_dict(fitting, strict=False)
    log.info("loaded %d tensors from %s; starting fresh: %s", len(fitting), path, ", ".join(reshaped) or "none")


def uses_channels_last(device_type: str, data_kind: str) -> bool:
    """Whether the model and its input batches are laid out channels_last (NHWC): image models on CUDA only.

    Under AMP, cuDNN's tensor-core convolutions work in NHWC, so an NCHW model pays a layout transpose around every
    convolution. On CUDA the weights are converted once (``train.run.loop``) and the fast path's ``Normalize``
    converts each batch while it is still uint8, before the four-times-larger float copy (``train.data``). On the
    CPU the layout stays as it was; feature heads have no spatial dimensions to lay out. One rule for the model and
    its batches: were they to disagree, every first convolution would convert its input again."""
    return device_type == "cuda" and data_kind == "images"


def logits_of(output: Any) -> torch.Tensor:
    """Models with auxiliary outputs return a named tuple; the loss wants the main logits."""
    return output if isinstance(output, torch.Tensor) else output.logits


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
