"""What every image backend shares by name: the ImageNet statistics and the interpolation names.

An interpolation is recorded by name (``"bilinear"``, ``"bicubic"``, ``"nearest"``: what specs, manifests and
checkpoints store); ``pil_resample`` and ``torchvision_mode`` turn a name into each library's constant, so no
other module spells those out or keeps its own list of valid names.
"""

from __future__ import annotations

from typing import Any

from shards.errors import InputError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
DEFAULT_INTERPOLATION = "bilinear"


def check_interpolation(name: str, field: str = "interpolation") -> str:
    """``name`` if it is a known interpolation, else an ``InputError`` naming ``field`` and the valid names."""
    if name not in INTERPOLATIONS:
        raise InputError(f"{field} {name!r} is unknown; choose one of {list(INTERPOLATIONS)}")
    return name


def pil_resample(name: str) -> Any:
    """PIL's resampling filter for an interpolation name (``Image.Resampling.BILINEAR`` for ``"bilinear"``)."""
    from PIL import Image

    return Image.Resampling[check_interpolation(name).upper()]


def torchvision_mode(name: str) -> Any:
    """torchvision's ``InterpolationMode`` for an interpolation name."""
    from torchvision.transforms import InterpolationMode

    return InterpolationMode(check_interpolation(name))
