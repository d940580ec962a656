"""The image transforms of feature precomputation, as data: an eval geometry and optional seeded augmented views.

Every transform ends in a uint8 [3, crop, crop] tensor; normalisation happens per batch on the model's device
(``shards.image.device.Normalize``). On the CPU path the geometry runs on PIL images exactly as torchvision's
``ImageClassification`` preset does, so features match the reference; ``--decode device`` runs the same geometry on
decoded tensors on the device; every backend takes its sizes and boxes from ``shards.image.geometry``. Augmented
view ``v`` of sample ``key`` draws its crop and flip from a generator seeded by (seed, key, v) only: the views do
not depend on worker count, batch size or shard order.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from shards.errors import InputError
from shards.image.fast import FastEval, resize_box
from shards.image.geometry import RANDOM_CROP_RATIO, Box, center_crop_box, eval_resize_size, train_view
from shards.image.options import DEFAULT_INTERPOLATION, check_interpolation, torchvision_mode


@dataclass(frozen=True)
class FeatureTransform:
    """Eval geometry and normalisation: resize the shorter side, take the centre crop, normalise."""

    resize: int
    crop: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str = DEFAULT_INTERPOLATION

    def __post_init__(self) -> None:
        if not 0 < self.crop <= self.resize:
            raise InputError(f"crop {self.crop} must be positive and at most resize {self.resize}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise InputError(f"mean {self.mean} and std {self.std} need three values each, std positive")
        check_interpolation(self.interpolation)

    def to_dict(self) -> dict[str, Any]:
        return {"resize": self.resize, "crop": self.crop, "mean": list(self.mean), "std": list(self.std),
                "interpolation": self.interpolation}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FeatureTransform":
        return cls(int(data["resize"]), int(data["crop"]), tuple(float(v) for v in data["mean"]),
                   tuple(float(v) for v in data["std"]), str(data.get("interpolation", DEFAULT_INTERPOLATION)))


@dataclass(frozen=True)
class AugmentSpec:
    """``views`` RandomResizedCrop + horizontal-flip views per image, seeded per (seed, key, view)."""

    views: int
    seed: int = 0
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = RANDOM_CROP_RATIO
    flip: bool = True

    def __post_init__(self) -> None:
        if self.views < 1:
            raise InputError(f"views {self.views} must be at least 1 when augmenting")
        if not 0 < self.scale[0] <= self.scale[1] <= 1 or not 0 < self.ratio[0] <= self.ratio[1]:
            raise InputError(f"augment scale {self.scale} or ratio {self.ratio} out of range")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["scale"], out["ratio"] = list(self.scale), list(self.ratio)
        return out


def view_rng(seed: int, key: str, view: int) -> random.Random:
    """A generator that depends on (seed, key, view) only (not on ``hash()``, which is salted per process)."""
    digest = hashlib.sha256(f"{seed}\0{key}\0{view}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def view_params(aug: AugmentSpec, key: str, view: int, width: int, height: int) -> tuple[Box, bool]:
    """View ``view`` of sample ``key``: the shared RandomResizedCrop box and flip (``geometry.train_view``)."""
    rng = view_rng(aug.seed, key, view)
    return train_view(width, height, aug.scale, aug.ratio, 0.5 if aug.flip else 0.0, rng)


def eval_fast(array, spec: FeatureTransform) -> torch.Tensor:
    """The eval geometry as one crop-then-resize on a decoded array (``--decode fast``; < 0.01 gray levels from
    ``eval_pil`` on the same pixels, see tests)."""
    return FastEval(spec.resize, spec.crop, interpolation=spec.interpolation).apply(array)


def views_fast(array, spec: FeatureTransform, aug: AugmentSpec, key: str) -> torch.Tensor:
    """[K, 3, crop, crop] uint8 augmented views of one decoded array, the same boxes and flips as ``views_pil``."""
    out = []
    for view in range(aug.views):
        box, flip = view_params(aug, key, view, array.shape[1], array.shape[0])
        crop = resize_box(array, box.ltrb(), (spec.crop, spec.crop), spec.interpolation)
        out.append(torch.from_numpy(np.ascontiguousarray(crop[:, ::-1] if flip else crop)).permute(2, 0, 1))
    return torch.stack(out)


def eval_pil(image, spec: FeatureTransform) -> torch.Tensor:
    """torchvision's eval preset on a PIL image, stopping at uint8 (normalisation happens on the device)."""
    import torchvision.transforms.functional as F

    size = eval_resize_size(image.width, image.height, spec.resize)
    image = F.resize(image, list(size), interpolation=torchvision_mode(spec.interpolation), antialias=True)
    return F.pil_to_tensor(F.crop(image, *center_crop_box(size.width, size.height, spec.crop)))


def views_pil(image, spec: FeatureTransform, aug: AugmentSpec, key: str) -> torch.Tensor:
    """[K, 3, crop, crop] uint8 augmented views of one PIL image."""
    import torchvision.transforms.functional as F

    out = []
    for view in range(aug.views):
        box, flip = view_params(aug, key, view, image.width, image.height)
        crop = F.resized_crop(image, *box, [spec.crop, spec.crop],
                              interpolation=torchvision_mode(spec.interpolation), antialias=True)
        out.append(F.pil_to_tensor(F.hflip(crop) if flip else crop))
    return torch.stack(out)


def eval_tensors(images: Sequence[torch.Tensor], spec: FeatureTransform) -> torch.Tensor:
    """The eval geometry on decoded uint8 tensors (any device): [B, 3, crop, crop] uint8."""
    from shards.image.device import resize_center_crop

    return torch.stack([resize_center_crop(im, spec.resize, spec.crop, spec.interpolation) for im in images])


def views_tensors(images: Sequence[torch.Tensor], keys: Sequence[str], spec: FeatureTransform,
                  aug: AugmentSpec) -> torch.Tensor:
    """[B, K, 3, crop, crop] uint8 augmented views of decoded tensors (same boxes and flips as the PIL path)."""
    from shards.image.device import resized_crop

    batch = []
    for image, key in zip(images, keys):
        height, width = image.shape[-2:]
        views = []
        for view in range(aug.views):
            box, flip = view_params(aug, key, view, int(width), int(height))
            views.append(resized_crop(image, box, spec.crop, flip, spec.interpolation))
        batch.append(torch.stack(views))
    return torch.stack(batch)
