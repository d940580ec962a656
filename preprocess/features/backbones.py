"""Frozen torchvision backbones by name, cut at the penultimate layer, with weights that never come from the network.

The penultimate features are the input of the final classifier layer. Each family keeps that layer under a
different attribute (``fc``, ``classifier``, ``heads``, ``head``), sometimes as the last ``Linear`` of a
``Sequential`` whose earlier layers (mobilenet_v3's hidden Linear, convnext's LayerNorm) belong to the features;
``FAMILIES`` maps a name prefix to that attribute, and the layer becomes ``Identity``.

Weights are ``none`` (random init from an explicit seed), a local file (loaded with ``weights_only=True``, strictly),
or a torchvision weights name whose file already sits in the local torch hub cache. Nothing is ever downloaded:
batch nodes are often offline, and a silent download would make a run depend on the network.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from shards.atomic import sha256_file
from shards.errors import InputError, MissingInputError
from shards.suggest import did_you_mean
from shards.formats.weights import read_state_dict

log = logging.getLogger(__name__)

# Name prefix -> attribute holding the final classifier layer (a Linear, or a Sequential ending in one).
# Longest prefix wins, so "mobilenet_v3" is not mistaken for something shorter.
FAMILIES: dict[str, str] = {
    "resnet": "fc",
    "resnext": "fc",
    "wide_resnet": "fc",
    "regnet": "fc",
    "shufflenet": "fc",
    "densenet": "classifier",
    "efficientnet": "classifier",
    "mobilenet_v2": "classifier",
    "mobilenet_v3": "classifier",
    "mnasnet": "classifier",
    "convnext": "classifier",
    "maxvit": "classifier",
    "alexnet": "classifier",
    "vgg": "classifier",
    "vit": "heads",
    "swin": "head",
}

_HUB_NAME = re.compile(r"^(?P<stem>.+)-(?P<hash>[0-9a-f]{6,})\.(pth|pt)\Z")


@dataclass(frozen=True)
class Backbone:
    """A headless eval-mode model and what identifies it: the features it outputs depend on nothing else."""

    name: str
    model: nn.Module
    features_dim: int
    weights: str  # "none", a file path, or a torchvision weights name
    weights_sha256: str | None  # None only for random init
    init_seed: int | None  # the seed of a random init, else None
    eval_preset: Mapping[str, Any] | None  # resize/crop/mean/std/interpolation from the weights' metadata
    input_size: int | None  # the only input size the model accepts (vit), else None


def family_of(name: str) -> str:
    matches = [prefix for prefix in FAMILIES if name.startswith(prefix)]
    if not matches:
        raise InputError(
            f"backbone {name!r} is not supported; families: {', '.join(sorted(FAMILIES))} "
            "(e.g. resnet50, efficientnet_b0, mobilenet_v3_large, convnext_tiny, regnet_y_400mf, vit_b_16)"
        )
    return max(matches, key=len)


def _check_name(name: str) -> None:
    import torchvision.models as models

    known = models.list_models(module=models)
    if name not in known:
        raise InputError(f"unknown backbone {name!r}" + did_you_mean(
            name, known, more="; torchvision classification models include resnet50, efficientnet_b0, vit_b_16, ..."))
    family_of(name)


def strip_classifier(model: nn.Module, name: str) -> int:
    """Replace the final classifier Linear by Identity in place; return the feature width it received."""
    attribute = FAMILIES[family_of(name)]
    head = getattr(model, attribute)
    if isinstance(head, nn.Linear):
        setattr(model, attribute, nn.Identity())
        return head.in_features
    if isinstance(head, nn.Sequential):
        for index in range(len(head) - 1, -1, -1):
            if isinstance(head[index], nn.Linear):
                width = head[index].in_features
                # Layers after the final Linear (none in torchvision today) would act on logits: drop them too.
                kept = list(head.children())[:index] + [nn.Identity()]
                setattr(model, attribute, nn.Sequential(*kept))
                return width
    raise InputError(f"backbone {name!r}: found no Linear classifier under .{attribute}")


def _weights_enum(name: str, weights_name: str):
    import torchvision.models as models

    enum = models.get_model_weights(name)
    member = weights_name.split(".")[-1]
    try:
        return enum[member]
    except KeyError:
        raise InputError(f"--weights {weights_name!r}: not a file and not a weights name of {name} "
                         f"(known: {', '.join(w.name for w in enum)}, DEFAULT)") from None


def _weights_for_file_name(name: str, sha256: str):
    """The torchvision weights whose published file name carries this file's sha256 prefix, if any."""
    import torchvision.models as models

    for weights in models.get_model_weights(name):
        match = _HUB_NAME.match(Path(weights.url).name)
        if match and sha256.startswith(match["hash"]):
            return weights
    return None


def eval_preset(weights) -> dict[str, Any]:
    """resize/crop/mean/std/interpolation from a torchvision weights' own eval transform."""
    preset = weights.transforms()
    return {
        "resize": int(preset.resize_size[0]),
        "crop": int(preset.crop_size[0]),
        "mean": [float(v) for v in preset.mean],
        "std": [float(v) for v in preset.std],
        "interpolation": preset.interpolation.value,
    }


def _builder_kwargs(name: str, weights) -> dict[str, Any]:
    """Constructor arguments the weights need (class count; vit's input size for the SWAG weights)."""
    if weights is None:
        return {}
    kwargs: dict[str, Any] = {"num_classes": len(weights.meta["categories"])}
    if family_of(name) == "vit":
        kwargs["image_size"] = int(weights.meta["min_size"][0])
    return kwargs


def _load_strict(model: nn.Module, state: Mapping[str, torch.Tensor], name: str, where: str) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    mismatched = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or mismatched:
        parts = [f"{len(v)} {label} (e.g. {v[0]})" for v, label in
                 ((missing, "missing keys"), (unexpected, "unexpected keys"), (mismatched, "shape mismatches")) if v]
        raise InputError(f"weights do not fit {name}: {', '.join(parts)}", path=where)
    model.load_state_dict(state, strict=True)


def hub_checkpoint_path(weights) -> Path:
    """Where torch.hub keeps a torchvision weights file once downloaded: the only place names are looked up."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name


def resolve_weights(name: str, weights: str) -> tuple[Path | None, Any]:
    """``weights`` as (local file or None, torchvision weights metadata or None); raises a clear offline error."""
    if weights == "none":
        return None, None
    path = Path(weights)
    if path.is_file() or path.suffix in (".pt", ".pth", ".safetensors", ".bin") or os.sep in weights:
        if not path.is_file():
            raise MissingInputError("weights file not found", path=str(path))
        return path, None
    meta = _weights_enum(name, weights)
    cached = hub_checkpoint_path(meta)
    if not cached.is_file():
        raise InputError(
            f"weights {meta} are not in the local torch cache ({cached}) and this tool never downloads; "
            f"fetch {meta.url} where there is network and pass --weights /path/to/{cached.name} "
            f"(or copy it to {cached.parent})"
        )
    return cached, meta


def build_backbone(name: str, weights: str = "none", *, seed: int = 0) -> Backbone:
    """Build ``name`` headless and frozen in eval mode; ``weights``: "none", a local file, or a cached weights name."""
    _check_name(name)
    import torchvision.models as models

    path, meta = resolve_weights(name, weights)
    source = "none" if path is None else (str(meta) if meta is not None else str(path.resolve()))
    sha256 = sha256_file(path) if path is not None else None
    if meta is None and sha256 is not None:
        meta = _weights_for_file_name(name, sha256)
        if meta is not None:
            log.info("weights %s match torchvision's %s: using its eval transform", path, meta)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # random init is a function of the seed, never of global state
        model = models.get_model(name, weights=None, **_builder_kwargs(name, meta))
    if path is not None:
        _load_strict(model, read_state_dict(path), name, str(path))
    features_dim = strip_classifier(model, name)
    model.eval().requires_grad_(False)
    input_size = int(model.image_size) if family_of(name) == "vit" else None
    return Backbone(
        name=name,
        model=model,
        features_dim=features_dim,
        weights=source,
        weights_sha256=sha256,
        init_seed=seed if path is None else None,
        eval_preset=eval_preset(meta) if meta is not None else None,
        input_size=input_size,
    )


def build_model(name: str, weights: str = "none", *, seed: int = 0) -> tuple[nn.Module, int]:
    """The headless model and its feature width: the short form of ``build_backbone``."""
    backbone = build_backbone(name, weights, seed=seed)
    return backbone.model, backbone.features_dim
