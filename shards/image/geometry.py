"""Crop geometry shared by every image backend: which source pixels an eval or augmented view shows.

Each geometric decision is one pure function of the image size (and, for augmentation, a ``random.Random``), so
the PIL pipeline, the fast uint8 path (``shards.image.fast``) and the device path (``shards.image.device``) cut
exactly the same boxes. Sizes go in as ``(width, height)``, PIL's order; boxes come out as ``Box`` in
torchvision's order (top, left, height, width), converted with ``Box.ltrb`` where PIL wants left-top-right-bottom.
Nothing here imports torch or PIL, and nothing reads a global random generator.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

RANDOM_CROP_RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's default range of aspect ratios (width / height)
CROP_PCT = 0.875  # the eval preset's centre crop covers this fraction of the resized shorter side (timm's crop_pct)


def default_eval_resize(size: int) -> int:
    """The eval preset's resize of the shorter side for a ``size`` crop: ``size / CROP_PCT`` (224 -> 256)."""
    return int(round(size / CROP_PCT))


class Box(NamedTuple):
    """A crop in whole pixels, in torchvision's argument order: ``F.crop(image, *box)``."""

    top: int
    left: int
    height: int
    width: int

    @property
    def bottom(self) -> int:
        return self.top + self.height

    @property
    def right(self) -> int:
        return self.left + self.width

    def ltrb(self) -> tuple[int, int, int, int]:
        """PIL's (left, upper, right, lower) order, for ``Image.crop`` and ``Image.resize(box=...)``."""
        return self.left, self.top, self.right, self.bottom


class Size(NamedTuple):
    """An image size in torchvision's order (``F.resize(image, list(size))``)."""

    height: int
    width: int


def eval_resize_size(width: int, height: int, resize: int) -> Size:
    """torchvision's ``Resize(resize)``: the shorter side becomes ``resize``, the longer one keeps the aspect
    ratio, truncated to whole pixels."""
    if width <= height:
        return Size(int(resize * height / width), resize)
    return Size(resize, int(resize * width / height))


def center_crop_box(width: int, height: int, crop: int) -> Box:
    """torchvision's ``CenterCrop(crop)`` of a ``width`` x ``height`` image (offsets rounded half to even, as
    torchvision does); the image must be at least ``crop`` on both sides."""
    if crop > min(width, height):
        raise ValueError(f"a {crop}px centre crop does not fit a {width}x{height} image")
    return Box(int(round((height - crop) / 2.0)), int(round((width - crop) / 2.0)), crop, crop)


def eval_source_region(width: int, height: int, resize: int, crop: int) -> tuple[float, float, float, float]:
    """The part of the source image that ``Resize(resize)`` + ``CenterCrop(crop)`` ends up showing, in PIL's
    (left, upper, right, lower) order and fractional source pixels: one ``Image.resize(box=...)`` reproduces the
    eval geometry without resizing the pixels that the crop throws away."""
    size = eval_resize_size(width, height, resize)
    box = center_crop_box(size.width, size.height, crop)
    scale_x, scale_y = size.width / width, size.height / height
    return box.left / scale_x, box.top / scale_y, box.right / scale_x, box.bottom / scale_y


def random_resized_crop_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
                            rng: random.Random) -> Box:
    """torchvision's ``RandomResizedCrop.get_params``, drawing from ``rng`` instead of torch's global generator."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        crop_width = int(round(math.sqrt(target_area * aspect)))
        crop_height = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_width <= width and 0 < crop_height <= height:
            top = rng.randint(0, height - crop_height)
            left = rng.randint(0, width - crop_width)
            return Box(top, left, crop_height, crop_width)
    in_ratio = width / height  # torchvision's fallback: the central crop at the nearest allowed aspect ratio
    if in_ratio < min(ratio):
        crop_width, crop_height = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        crop_width, crop_height = int(round(height * max(ratio))), height
    else:
        crop_width, crop_height = width, height
    return Box((height - crop_height) // 2, (width - crop_width) // 2, crop_height, crop_width)


def flip_decision(probability: float, rng: random.Random) -> bool:
    """Whether to mirror a view horizontally: one draw from ``rng``, true with ``probability``."""
    return rng.random() < probability


def train_view(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], hflip: float,
               rng: random.Random) -> tuple[Box, bool]:
    """One augmented view: the ``RandomResizedCrop`` box, then the flip, drawn from ``rng`` in that order."""
    box = random_resized_crop_box(width, height, scale, ratio, rng)
    return box, flip_decision(hflip, rng)
