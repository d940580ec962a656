"""The fast path: encoded bytes to uint8 CHW tensors at the size the model wants, normalised later per batch.

Why it is fast: the standard pipeline decodes with PIL, resizes with PIL, crops, converts to float and normalises
per sample in a worker, then ships 4-byte floats through the queues. Here a worker does only
``decode (simplejpeg when importable; DCT-scaled when the JPEG is >= 2x the target) -> one antialiased bilinear
resize with torch's uint8 kernel -> crop -> uint8``, and ``Normalize`` (from ``shards.image.device``) turns a
whole batch into float on the consuming device. The geometry is torchvision's (Resize + CenterCrop as resize then
crop; RandomResizedCrop as crop then resize), computed on the decoded size, so pixels match the PIL reference to
well under one gray level (see tests and ``scripts/bench/loader.py``). Other interpolations go through
``PIL.Image.resize(box=...)``.
"""

from __future__ import annotations

import math
import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from shards.image.decode import JPEG_MAGIC, decode_image, jpeg_orientation
from shards.image.device import IMAGENET_MEAN, IMAGENET_STD, Normalize
from shards.errors import CorruptDataError, InputError

__all__ = ["FastDecoder", "FastEval", "FastTrain", "Normalize", "decode_rgb_array", "draft_factor", "jpeg_orientation",
           "random_resized_crop_box", "IMAGENET_MEAN", "IMAGENET_STD"]

try:  # libjpeg-turbo without PIL's per-call overhead; optional, PIL is the fallback and handles other formats
    import simplejpeg
except ImportError:  # pragma: no cover - exercised where simplejpeg is absent
    simplejpeg = None



def draft_factor(short_side: int, min_size: int) -> int:
    """The largest of 8, 4, 2 that keeps the short side >= ``min_size`` (1: decode at full size)."""
    for factor in (8, 4, 2):
        if short_side >= min_size * factor:
            return factor
    return 1


def decode_rgb_array(data: bytes, min_size: int | None = None) -> np.ndarray:
    """Decode to an RGB ``uint8[H, W, 3]`` array, EXIF orientation applied.

    ``min_size``: the shorter side the transform needs; a JPEG at least twice that is decoded at 1/2, 1/4 or 1/8
    scale by the decoder itself (DCT scaling), never below ``min_size``.
    """
    if simplejpeg is not None and data[:2] == JPEG_MAGIC and jpeg_orientation(data) == 1:
        try:
            factor = 1
            if min_size is not None:
                height, width = simplejpeg.decode_jpeg_header(data)[:2]
                factor = draft_factor(min(height, width), min_size)
            if factor == 1:
                return simplejpeg.decode_jpeg(data, colorspace="RGB")
            # libjpeg-turbo also offers 3/4, 5/8, ...: pin the scale to 1/factor, where pixels stay faithful.
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-height // factor),
                                          min_width=-(-width // factor))
        except ValueError:
            pass  # CMYK, lossless or unusual JPEGs: PIL handles them below
    return np.asarray(decode_image(data, draft_size=None if min_size is None else (min_size, min_size)))


def _to_chw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1)


RESAMPLING = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}


def resize_box(array: np.ndarray, box: tuple[float, float, float, float], size: tuple[int, int],
                interpolation: str = "bilinear") -> np.ndarray:
    """Resize only ``box`` (left, top, right, bottom in source pixels) to ``size`` = (width, height)."""
    image = Image.fromarray(array)
    return np.asarray(image.resize(size, RESAMPLING[interpolation], box=box, reducing_gap=3.0))


def _resize_bilinear(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Antialiased bilinear resize of a uint8 [3, H, W] tensor: PIL's filter, to within a gray level, 2-3x faster.

    torch's uint8 kernel is vectorised for channels-last input, which an HWC array viewed as CHW already is;
    the PIL resize was half of a worker's time per image.
    """
    out = F.interpolate(image.unsqueeze(0), size=(height, width), mode="bilinear", antialias=True,
                        align_corners=False)
    return out[0]


def _hwc_view(array: np.ndarray) -> torch.Tensor:
    """An RGB ``uint8[H, W, 3]`` array as a [3, H, W] tensor sharing its memory (no copy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PIL-decoded arrays are read-only; nothing writes to them
        return torch.from_numpy(array).permute(2, 0, 1)


def random_resized_crop_box(width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float],
                            rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's ``RandomResizedCrop.get_params`` drawn from ``rng``: (left, top, right, bottom)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return (left, top, left + w, top + h)
    in_ratio = width / height  # torchvision's fallback: the central crop at the nearest allowed aspect ratio
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return (left, top, left + w, top + h)


@dataclass(frozen=True)
class FastEval:
    """Resize(``resize``) + CenterCrop(``crop``), emitting uint8 CHW (bilinear: resize then crop, like torchvision;
    other interpolations: one PIL resize of just the crop box)."""

    resize: int = 256
    crop: int = 224
    draft: bool = True
    interpolation: str = "bilinear"

    def __call__(self, data: bytes, seed: int = 0) -> torch.Tensor:
        array = decode_rgb_array(data, self.resize if self.draft else None)
        return self.apply(array)

    def apply(self, array: np.ndarray) -> torch.Tensor:
        """The eval geometry on an already decoded RGB array."""
        height, width = array.shape[:2]
        if self.interpolation == "bilinear":  # torchvision's own order (resize, then crop) on torch's fast kernel
            new_w, new_h, left, top = self.resized_crop(width, height)
            resized = _resize_bilinear(_hwc_view(array), new_h, new_w)
            return resized[:, top : top + self.crop, left : left + self.crop].contiguous()
        box = self.box(width, height)
        return _to_chw(resize_box(array, box, (self.crop, self.crop), self.interpolation))

    def resized_crop(self, width: int, height: int) -> tuple[int, int, int, int]:
        """torchvision's Resize(resize) output size and CenterCrop(crop) offset: (new_w, new_h, left, top)."""
        new_w, new_h = (self.resize, int(self.resize * height / width)) if width <= height else (
            int(self.resize * width / height), self.resize)
        return new_w, new_h, int(round((new_w - self.crop) / 2.0)), int(round((new_h - self.crop) / 2.0))

    def box(self, width: int, height: int) -> tuple[float, float, float, float]:
        """The source region torchvision's Resize(resize) + CenterCrop(crop) would end up showing."""
        new_w, new_h, left, top = self.resized_crop(width, height)
        sx, sy = new_w / width, new_h / height
        return (left / sx, top / sy, (left + self.crop) / sx, (top + self.crop) / sy)


@dataclass(frozen=True)
class FastTrain:
    """RandomResizedCrop(``size``) + horizontal flip (probability ``hflip``) on the decoded size, applied as crop-then-resize on uint8.

    Randomness comes from the per-sample ``seed`` the dataset passes (derived from seed, epoch and key), so the
    augmentation of a sample does not depend on worker count or on resuming.
    """

    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    interpolation: str = "bilinear"

    def __call__(self, data: bytes, seed: int = 0) -> torch.Tensor:
        rng = random.Random(seed)
        array = decode_rgb_array(data)
        left, top, right, bottom = self.crop_box(array.shape[1], array.shape[0], rng)
        flip = rng.random() < self.hflip
        if self.interpolation == "bilinear":  # an integer box: crop, then resize, exactly as torchvision does
            out = _resize_bilinear(_hwc_view(array)[:, top:bottom, left:right], self.size, self.size)
            return (out.flip(-1) if flip else out).contiguous()
        resized = resize_box(array, (left, top, right, bottom), (self.size, self.size), self.interpolation)
        return _to_chw(resized[:, ::-1] if flip else resized)

    def crop_box(self, width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
        return random_resized_crop_box(width, height, self.scale, self.ratio, rng)


class FastDecoder:
    """The reader's decode stage on the fast path: ``RawSample`` -> uint8 [3, size, size] for a ``TransformSpec``.

    Train samples draw their crop seed from torch's default generator, which the reader seeds per sample in its
    workers, so augmentations replay exactly on resume. ColorJitter has no uint8 counterpart here: such a spec
    is refused, and callers keep the standard pipeline for it.
    """

    def __init__(self, spec):
        if spec.color_jitter > 0:
            raise InputError("the fast pipeline has no ColorJitter; use the standard pipeline for color_jitter > 0")
        self.spec = spec
        if spec.preset == "train":
            self.geometry = FastTrain(spec.size, tuple(spec.scale), hflip=spec.hflip,
                                      interpolation=spec.interpolation)
        else:
            self.geometry = FastEval(spec.eval_resize, spec.size, interpolation=spec.interpolation)

    def normalizer(self, **options) -> Normalize:
        """The per-batch step that turns this decoder's uint8 output into the spec's normalised input."""
        return Normalize(self.spec.mean, self.spec.std, **options)

    def __call__(self, sample):
        seed = int(torch.randint(0, 2**62, (1,)).item()) if self.spec.preset == "train" else 0
        try:
            return self.geometry(sample.data, seed)
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise CorruptDataError(f"cannot decode .{sample.ext} image ({type(exc).__name__}: {exc})") from exc
