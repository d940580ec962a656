"""The fast path: encoded bytes to uint8 CHW tensors at the size the model wants, normalised later per batch.

Why it is fast: the standard pipeline decodes with PIL, resizes with PIL, crops, converts to float and normalises
per sample in a worker, then ships 4-byte floats through the queues. Here a worker does only
``decode (simplejpeg when importable; DCT-scaled when the JPEG is >= 2x the target) -> one antialiased bilinear
resize with torch's uint8 kernel -> crop -> uint8``, and ``Normalize`` (from ``shards.image.device``) turns a
whole batch into float on the consuming device. The boxes come from ``shards.image.geometry`` (torchvision's
Resize + CenterCrop as resize then crop; RandomResizedCrop as crop then resize), computed on the decoded size, and
the bilinear resizes are the device path's torchvision v2 ops on a channels-last view of the decoded array, so
pixels match the PIL reference to well under one gray level (see tests and ``scripts/bench/loader.py``). Other
interpolations go through one ``PIL.Image.resize(box=...)`` of just the region the crop shows.
"""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from shards.errors import CorruptDataError, InputError
from shards.image.decode import JPEG_MAGIC, decode_image, jpeg_orientation
from shards.image.device import Normalize
from shards.image.geometry import (Box, center_crop_box, eval_resize_size, eval_source_region, random_resized_crop_box,
                                   train_view)
from shards.procs.decode_mark import mark_decoded
from shards.image.options import IMAGENET_MEAN, IMAGENET_STD, pil_resample

__all__ = ["FastDecoder", "FastEval", "FastTrain", "Normalize", "bound_short_side", "decode_rgb_array", "draft_factor",
           "jpeg_orientation", "random_resized_crop_box", "IMAGENET_MEAN", "IMAGENET_STD"]

# What a decoder raises on bytes that are not a readable image; the decode stage turns them into CorruptDataError.
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)

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
            # libjpeg-turbo also offers 7/8, 3/4, 5/8, ...: on x86 their IDCTs have no SIMD, so they cost more CPU
            # than a full decode, and their pixels drift from the reference (docs/benchmarks.md, issue 45). Pin the
            # scale to 1/factor.
            return simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=-(-height // factor),
                                          min_width=-(-width // factor))
        except ValueError:
            pass  # CMYK, lossless or unusual JPEGs: PIL handles them below
    return np.asarray(decode_image(data, draft_size=None if min_size is None else (min_size, min_size)))


def _to_chw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1)


def resize_box(array: np.ndarray, box: tuple[float, float, float, float], size: tuple[int, int],
               interpolation: str = "bilinear") -> np.ndarray:
    """Resize only ``box`` (PIL's left, top, right, bottom, in source pixels) to ``size`` = (width, height)."""
    image = Image.fromarray(array)
    return np.asarray(image.resize(size, pil_resample(interpolation), box=box, reducing_gap=3.0))


def _hwc_view(array: np.ndarray) -> torch.Tensor:
    """An RGB ``uint8[H, W, 3]`` array as a [3, H, W] tensor sharing its memory (no copy)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # PIL-decoded arrays are read-only; nothing writes to them
        return torch.from_numpy(array).permute(2, 0, 1)


def _resize_bilinear(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Antialiased bilinear resize of a uint8 [3, H, W] CPU tensor: PIL's filter to within a gray level, 2-3x
    faster than PIL (whose resize was half of a worker's time per image).

    torch's uint8 kernel is vectorised for channels-last input, which an HWC array viewed as CHW already is. The
    same pixels as ``torchvision.transforms.v2.functional.resize`` (which ``shards.image.device`` uses, as it also
    runs on CUDA), without its ~10 us of dispatch per call.
    """
    return F.interpolate(image.unsqueeze(0), size=(height, width), mode="bilinear", antialias=True,
                         align_corners=False)[0]


def bound_short_side(array: np.ndarray, side: int, interpolation: str = "bilinear") -> np.ndarray:
    """``array`` resized so its shorter side is ``side`` (torchvision's ``Resize(side)`` sizes), or as it is when
    already no larger: a bounded source that every epoch crops from, so a cache of it (``shards.cache.images``)
    holds a known number of pixels per image whatever the stored resolution."""
    height, width = array.shape[:2]
    if min(height, width) <= side:
        return array
    size = eval_resize_size(width, height, side)
    if interpolation == "bilinear":
        resized = _resize_bilinear(_hwc_view(array), size.height, size.width)
        return resized.permute(1, 2, 0).contiguous().numpy()
    return resize_box(array, (0, 0, width, height), (size.width, size.height), interpolation)


@dataclass(frozen=True)
class FastEval:
    """Resize(``resize``) + CenterCrop(``crop``), emitting uint8 CHW (bilinear: resize then crop, like torchvision;
    other interpolations: one PIL resize of just the region the crop shows)."""

    resize: int = 256
    crop: int = 224
    draft: bool = True
    interpolation: str = "bilinear"

    def __call__(self, data: bytes, seed: int = 0) -> torch.Tensor:
        """Decode and apply the eval geometry; ``seed`` is accepted for a uniform interface and ignored."""
        return self.apply(self.decode(data))

    def decode(self, data: bytes) -> np.ndarray:
        return decode_rgb_array(data, self.resize if self.draft else None)

    def apply(self, array: np.ndarray, seed: int = 0) -> torch.Tensor:
        """The eval geometry on an already decoded RGB array (``seed`` ignored, as in ``__call__``)."""
        height, width = array.shape[:2]
        if self.interpolation == "bilinear":  # torchvision's own order (resize, then crop) on torch's fast kernel
            size = eval_resize_size(width, height, self.resize)
            box = center_crop_box(size.width, size.height, self.crop)
            resized = _resize_bilinear(_hwc_view(array), size.height, size.width)
            return resized[:, box.top : box.bottom, box.left : box.right].contiguous()
        region = eval_source_region(width, height, self.resize, self.crop)
        return _to_chw(resize_box(array, region, (self.crop, self.crop), self.interpolation))


@dataclass(frozen=True)
class FastTrain:
    """RandomResizedCrop(``size``) + horizontal flip (probability ``hflip``) on the decoded size, applied as
    crop-then-resize on uint8.

    The crop and the flip are drawn from ``random.Random(seed)`` only (``shards.image.geometry.train_view``), so the
    same seed gives the same view. In a stream the reader passes each sample's seed, derived from (seed, epoch,
    rank, worker, position): a run replays its augmentations exactly, also after a resume, and a different number
    of workers gives different (equally valid) ones.
    """

    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    interpolation: str = "bilinear"
    # None: crop from the image as decoded. A side: crop from the image bounded to that shorter side
    # (``bound_short_side``, JPEGs DCT-scaled down to it), the source an image cache keeps between epochs.
    source_side: int | None = None

    def __call__(self, data: bytes, seed: int) -> torch.Tensor:
        return self.apply(self.decode(data), seed)

    def decode(self, data: bytes) -> np.ndarray:
        if self.source_side is None:
            return decode_rgb_array(data)
        return bound_short_side(decode_rgb_array(data, self.source_side), self.source_side, self.interpolation)

    def apply(self, array: np.ndarray, seed: int) -> torch.Tensor:
        """The crop, flip and resize ``seed`` gives, on an already decoded RGB array."""
        box, flip = self.view(array.shape[1], array.shape[0], seed)
        if self.interpolation == "bilinear":  # an integer box: crop, then resize, exactly as torchvision does
            crop = _hwc_view(array)[:, box.top : box.bottom, box.left : box.right]
            resized = _resize_bilinear(crop, self.size, self.size)
            return (resized.flip(-1) if flip else resized).contiguous()
        resized = resize_box(array, box.ltrb(), (self.size, self.size), self.interpolation)
        return _to_chw(resized[:, ::-1] if flip else resized)

    def view(self, width: int, height: int, seed: int) -> tuple[Box, bool]:
        """The crop box and flip decision that ``seed`` gives an image of this size."""
        return train_view(width, height, self.scale, self.ratio, self.hflip, random.Random(seed))


class FastDecoder:
    """The reader's decode stage on the fast path: ``(RawSample, seed)`` -> uint8 [3, size, size] for a
    ``TransformSpec``.

    A train spec's crop and flip come from the per-sample ``seed`` the reader passes (no global random state), so
    augmentations replay exactly on resume. ColorJitter has no uint8 counterpart here: such a spec is refused, and
    callers keep the standard pipeline for it. ``source_side`` (train only) crops every view from the image bounded
    to that shorter side (``FastTrain.source_side``), the source ``open_dataset(cache="memory")`` keeps in memory.

    Each call marks where it finished decoding and began the geometry (``shards.procs.stage_times.mark_decoded``),
    where the reader's stage timing splits decode from transform.
    """

    def __init__(self, spec, source_side: int | None = None):
        if spec.color_jitter > 0:
            raise InputError("the fast pipeline has no ColorJitter; use the standard pipeline for color_jitter > 0")
        if source_side is not None and spec.preset != "train":
            raise InputError(f"source_side={source_side} bounds the train preset's source; the eval preset has its "
                             "own resize")
        self.spec = spec
        self.source_side = source_side
        if spec.preset == "train":
            self.geometry = FastTrain(spec.size, tuple(spec.scale), hflip=spec.hflip,
                                      interpolation=spec.interpolation, source_side=source_side)
        else:
            self.geometry = FastEval(spec.eval_resize, spec.size, interpolation=spec.interpolation)

    def normalizer(self, **options) -> Normalize:
        """The per-batch step that turns this decoder's uint8 output into the spec's normalised input."""
        return Normalize(self.spec.mean, self.spec.std, **options)

    def __call__(self, sample, seed: int) -> torch.Tensor:
        try:
            array = self.geometry.decode(sample.data)
            mark_decoded()
            return self.geometry.apply(array, seed)
        except DECODE_ERRORS as exc:
            raise undecodable(sample, exc) from exc


def undecodable(sample, exc: BaseException) -> CorruptDataError:
    """The error a sample whose bytes do not decode becomes, naming its format and the decoder's complaint."""
    return CorruptDataError(f"cannot decode .{sample.ext} image ({type(exc).__name__}: {exc})")
