"""Transform presets: the standard ImageNet-style train and eval pipelines, with sizes as fields, not magic strings.

A ``TransformSpec`` is a frozen, JSON-friendly record (it goes into feature manifests and checkpoints, so a model
knows how its inputs were made); ``build_transform`` turns it into a torchvision pipeline. ``draft_size`` tells the
decoder how small a JPEG may be decoded (``Image.draft``) without changing what the transform sees much.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from shards.image.device import IMAGENET_MEAN, IMAGENET_STD
from shards.errors import InputError

PRESETS = ("train", "eval")


@dataclass(frozen=True)
class TransformSpec:
    """``train``: RandomResizedCrop(size, scale), horizontal flip, optional ColorJitter, ToTensor, Normalize.
    ``eval``: Resize(resize_size), CenterCrop(size), ToTensor, Normalize."""

    preset: str = "eval"
    size: int = 224
    resize_size: int | None = None  # eval only; default size / 0.875 (224 -> 256)
    scale: tuple[float, float] = (0.08, 1.0)
    hflip: float = 0.5
    color_jitter: float = 0.0  # brightness = contrast = saturation = this, hue = this / 4; 0 turns it off
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise InputError(f"transform preset {self.preset!r} is unknown; choose one of {list(PRESETS)}")
        if self.size < 1 or (self.resize_size is not None and self.resize_size < self.size):
            raise InputError(f"transform sizes must satisfy 1 <= size <= resize_size, got {self.size}, "
                             f"{self.resize_size}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise InputError(f"transform scale must satisfy 0 < min <= max <= 1, got {self.scale}")
        if not 0 <= self.hflip <= 1 or self.color_jitter < 0:
            raise InputError(f"hflip must be in [0, 1] and color_jitter >= 0, got {self.hflip}, {self.color_jitter}")
        if self.interpolation not in ("bilinear", "bicubic", "nearest"):
            raise InputError(f"interpolation {self.interpolation!r} is unknown; use bilinear, bicubic or nearest")

    @property
    def eval_resize(self) -> int:
        return self.resize_size if self.resize_size is not None else int(round(self.size / 0.875))

    @property
    def draft_size(self) -> tuple[int, int]:
        """The smallest decode that keeps the transform's input resolution (both sides at least this)."""
        side = self.eval_resize if self.preset == "eval" else self.size
        return side, side

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TransformSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise InputError(f"unknown transform fields {unknown}; known: {sorted(fields)}")
        values = dict(data)
        for name in ("scale", "mean", "std"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


def build_transform(spec: TransformSpec | str = "eval", **changes: Any) -> Callable:
    """A torchvision pipeline from a spec or a preset name (``build_transform("train", size=160)``)."""
    from torchvision import transforms as T

    if isinstance(spec, str):
        spec = TransformSpec(preset=spec, **changes)
    elif changes:
        spec = dataclasses.replace(spec, **changes)
    mode = getattr(T.InterpolationMode, spec.interpolation.upper())
    steps: list[Callable] = []
    if spec.preset == "train":
        steps.append(T.RandomResizedCrop(spec.size, scale=spec.scale, interpolation=mode))
        if spec.hflip > 0:
            steps.append(T.RandomHorizontalFlip(spec.hflip))
        if spec.color_jitter > 0:
            c = spec.color_jitter
            steps.append(T.ColorJitter(brightness=c, contrast=c, saturation=c, hue=min(0.5, c / 4)))
    else:
        steps += [T.Resize(spec.eval_resize, interpolation=mode), T.CenterCrop(spec.size)]
    steps += [T.ToTensor(), T.Normalize(spec.mean, spec.std)]
    return T.Compose(steps)


def train_transform(size: int = 224, **options: Any) -> Callable:
    return build_transform(TransformSpec(preset="train", size=size, **options))


def eval_transform(size: int = 224, **options: Any) -> Callable:
    return build_transform(TransformSpec(preset="eval", size=size, **options))
