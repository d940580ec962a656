"""The image transforms of feature precomputation: the eval ``TransformSpec`` and optional seeded augmented views.

The transform is the library's one spec type (``shards.image.transforms.TransformSpec``, eval preset: ``size`` is
the crop, ``eval_resize`` the shorter side), so precomputed features and a trained model describe their inputs
alike. Every transform here ends in a uint8 [3, crop, crop] tensor; normalisation happens per batch on the model's
device (``shards.image.device.Normalize``). On the CPU path the PIL steps are the library's own (``eval_view``,
``crop_view``: torchvision's ``ImageClassification`` preset pixel for pixel), so features match the reference;
``--decode device`` runs the same geometry on decoded tensors on the device; every backend takes its sizes and boxes
from ``shards.image.geometry``. Augmented view ``v`` of sample ``key`` draws its crop and flip from a generator
seeded by (seed, key, v) only: the views do not depend on worker count, batch size or shard order.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from shards.errors import InputError
from shards.image.fast import FastEval, resize_box
from shards.image.geometry import RANDOM_CROP_RATIO, Box, train_view
from shards.image.transforms import TransformSpec, crop_view, eval_view


def transform_record(spec: TransformSpec) -> dict[str, Any]:
    """The transform as ``features.json`` records it and its config hash covers: exactly what the eval transform
    does (resize, crop, normalisation, filter). The spec's train-only fields (scale, flip, jitter) play no part in
    it, so they are left out: a change of their defaults must not make every feature folder stale."""
    return {"resize": spec.eval_resize, "crop": spec.size, "mean": list(spec.mean), "std": list(spec.std),
            "interpolation": spec.interpolation}


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


def eval_fast(array, spec: TransformSpec) -> torch.Tensor:
    """The eval geometry as one crop-then-resize on a decoded array (``--decode fast``; < 0.01 gray levels from
    ``eval_pil`` on the same pixels, see tests)."""
    return FastEval(spec.eval_resize, spec.size, interpolation=spec.interpolation).apply(array)


def views_fast(array, spec: TransformSpec, aug: AugmentSpec, key: str) -> torch.Tensor:
    """[K, 3, crop, crop] uint8 augmented views of one decoded array, the same boxes and flips as ``views_pil``."""
    out = []
    for view in range(aug.views):
        box, flip = view_params(aug, key, view, array.shape[1], array.shape[0])
        crop = resize_box(array, box.ltrb(), (spec.size, spec.size), spec.interpolation)
        out.append(torch.from_numpy(np.ascontiguousarray(crop[:, ::-1] if flip else crop)).permute(2, 0, 1))
    return torch.stack(out)


def eval_pil(image, spec: TransformSpec) -> torch.Tensor:
    """The library's eval view of a PIL image, stopping at uint8 (normalisation happens on the device)."""
    import torchvision.transforms.functional as F

    return F.pil_to_tensor(eval_view(image, spec))


def views_pil(image, spec: TransformSpec, aug: AugmentSpec, key: str) -> torch.Tensor:
    """[K, 3, crop, crop] uint8 augmented views of one PIL image, each the library's ``crop_view``."""
    import torchvision.transforms.functional as F

    views = [crop_view(image, *view_params(aug, key, view, image.width, image.height), spec)
             for view in range(aug.views)]
    return torch.stack([F.pil_to_tensor(view) for view in views])


def eval_tensors(images: Sequence[torch.Tensor], spec: TransformSpec) -> torch.Tensor:
    """The eval geometry on decoded uint8 tensors (any device): [B, 3, crop, crop] uint8. On an accelerator the whole
    batch is resized in one kernel (``shards.image.batch_crops``, bilinear only); on the CPU, where that kernel is
    9x slower than a resize per image, one antialiased resize per image."""
    from shards.image.batch_crops import eval_crops
    from shards.image.device import resize_center_crop

    if images and images[0].device.type != "cpu" and spec.interpolation == "bilinear":
        return eval_crops(images, spec.eval_resize, spec.size)
    return torch.stack([resize_center_crop(im, spec.eval_resize, spec.size, spec.interpolation) for im in images])


def views_tensors(images: Sequence[torch.Tensor], keys: Sequence[str], spec: TransformSpec,
                  aug: AugmentSpec) -> torch.Tensor:
    """[B, K, 3, crop, crop] uint8 augmented views of decoded tensors (same boxes and flips as the PIL path)."""
    from shards.image.device import resized_crop

    batch = []
    for image, key in zip(images, keys):
        height, width = image.shape[-2:]
        views = []
        for view in range(aug.views):
            box, flip = view_params(aug, key, view, int(width), int(height))
            views.append(resized_crop(image, box, spec.size, flip, spec.interpolation))
        batch.append(torch.stack(views))
    return torch.stack(batch)
