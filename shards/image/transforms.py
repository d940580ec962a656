"""Transform presets: the standard ImageNet-style train and eval pipelines, with sizes as fields, not magic strings.

A ``TransformSpec`` is the one description of an image transform: a frozen, JSON-friendly record that training,
checkpoints and feature precomputation all use, so a model knows how its inputs were made. ``build_transform`` turns
it into a ``PilTransform``, the standard (PIL) pipeline with its crop boxes from ``shards.image.geometry`` and its
randomness from an explicit per-sample seed. Its two PIL steps, ``eval_view`` (resize, centre crop) and
``crop_view`` (one box resized to the crop, maybe flipped), are the only PIL assembly of those geometries:
``preprocess.features`` builds its uint8 eval inputs and augmented views on them. ``draft_size`` tells the decoder
how small a JPEG may be decoded (``Image.draft``) without changing what the transform sees much.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from shards.errors import InputError
from shards.image.geometry import (RANDOM_CROP_RATIO, Box, center_crop_box, default_eval_resize, eval_resize_size,
                                   train_view)
from shards.image.options import IMAGENET_MEAN, IMAGENET_STD, check_interpolation, torchvision_mode

if TYPE_CHECKING:  # torch is imported on first use, so reading a spec from a manifest stays light
    import torch

PRESETS = ("train", "eval")


@dataclass(frozen=True)
class TransformSpec:
    """``train``: RandomResizedCrop(size, scale), horizontal flip, optional ColorJitter, ToTensor, Normalize.
    ``eval``: Resize(resize_size), CenterCrop(size), ToTensor, Normalize."""

    preset: str = "eval"
    size: int = 224
    resize_size: int | None = None  # eval only; default size / CROP_PCT (224 -> 256)
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
            raise InputError(f"transform crop size {self.size} must be at least 1 and at most the resize "
                             f"{self.resize_size}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise InputError(f"transform scale must satisfy 0 < min <= max <= 1, got {self.scale}")
        if not 0 <= self.hflip <= 1 or self.color_jitter < 0:
            raise InputError(f"hflip must be in [0, 1] and color_jitter >= 0, got {self.hflip}, {self.color_jitter}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise InputError(f"transform mean {self.mean} and std {self.std} need three values each, std positive")
        check_interpolation(self.interpolation)

    @property
    def eval_resize(self) -> int:
        return self.resize_size if self.resize_size is not None else default_eval_resize(self.size)

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


@dataclass(frozen=True)
class PilTransform:
    """A ``TransformSpec`` applied to a PIL image: a normalised float [3, size, size] tensor.

    ``eval`` gives torchvision's Resize + CenterCrop + ToTensor + Normalize pixel for pixel. ``train`` draws its
    RandomResizedCrop box, flip and ColorJitter factors from ``random.Random(seed)`` only, with the same box
    function as the fast path: the same ``seed`` gives the same view, and no global random state is read or
    changed. ``transform(image)`` without a seed draws one from torch's global generator, as torchvision's own
    transforms do, so a plain DataLoader still augments each call differently and ``torch.manual_seed`` replays it.
    """

    spec: TransformSpec

    def __call__(self, image: Any, seed: int | None = None) -> torch.Tensor:
        import torchvision.transforms.functional as F

        spec = self.spec
        if spec.preset == "eval":
            image = eval_view(image, spec)
        else:
            if seed is None:
                import torch

                seed = int(torch.randint(0, 2**62, (1,)).item())
            rng = random.Random(seed)
            image = crop_view(image, *train_view(image.width, image.height, spec.scale, RANDOM_CROP_RATIO,
                                                 spec.hflip, rng), spec)
            if spec.color_jitter > 0:
                image = color_jitter(image, spec.color_jitter, rng)
        return F.normalize(F.to_tensor(image), spec.mean, spec.std)


def eval_view(image: Any, spec: TransformSpec) -> Any:
    """The eval geometry on a PIL image, torchvision's Resize(eval_resize) + CenterCrop(size) pixel for pixel: a PIL
    image of ``spec.size`` square, before any conversion (callers want floats or uint8)."""
    import torchvision.transforms.functional as F

    size = eval_resize_size(image.width, image.height, spec.eval_resize)
    image = F.resize(image, list(size), interpolation=torchvision_mode(spec.interpolation), antialias=True)
    return F.crop(image, *center_crop_box(size.width, size.height, spec.size))


def crop_view(image: Any, box: Box, flip: bool, spec: TransformSpec) -> Any:
    """One augmented view of a PIL image: ``box`` resized to ``spec.size`` square, mirrored when ``flip``; the box
    and flip come from the caller's seeded draw (``geometry.train_view``), so this step draws nothing."""
    import torchvision.transforms.functional as F

    image = F.resized_crop(image, *box, [spec.size, spec.size], interpolation=torchvision_mode(spec.interpolation),
                           antialias=True)
    return F.hflip(image) if flip else image


def color_jitter(image: Any, strength: float, rng: random.Random) -> Any:
    """torchvision's ``ColorJitter(strength, strength, strength, min(0.5, strength / 4))``, drawing its order and
    factors from ``rng`` (in torchvision's sequence: order, brightness, contrast, saturation, hue)."""
    import torchvision.transforms.functional as F

    order = rng.sample(range(4), 4)
    low = max(0.0, 1.0 - strength)
    brightness, contrast, saturation = (rng.uniform(low, 1.0 + strength) for _ in range(3))
    hue_range = min(0.5, strength / 4)
    hue = rng.uniform(-hue_range, hue_range)
    adjust = (lambda im: F.adjust_brightness(im, brightness), lambda im: F.adjust_contrast(im, contrast),
              lambda im: F.adjust_saturation(im, saturation), lambda im: F.adjust_hue(im, hue))
    for index in order:
        image = adjust[index](image)
    return image


def build_transform(spec: TransformSpec | str = "eval", **changes: Any) -> Callable:
    """The standard pipeline (a ``PilTransform``) from a spec or a preset name (``build_transform("train",
    size=160)``); call it as ``transform(image)`` or, for a replayable augmentation, ``transform(image, seed)``."""
    if isinstance(spec, str):
        spec = TransformSpec(preset=spec, **changes)
    elif changes:
        spec = dataclasses.replace(spec, **changes)
    return PilTransform(spec)


def train_transform(size: int = 224, **options: Any) -> Callable:
    return build_transform(TransformSpec(preset="train", size=size, **options))


def eval_transform(size: int = 224, **options: Any) -> Callable:
    return build_transform(TransformSpec(preset="eval", size=size, **options))
