"""Image work done where the model runs: batched JPEG decode, resize/crop and normalisation of uint8 batches.

Workers hand over uint8 images (4x smaller than float through queues and pinned memory); the float cast and the
mean/std normalisation happen once per batch on the consuming device (``Normalize``, usable in front of any model).
``decode_images`` decodes JPEG bytes in batches on the model's device (nvJPEG on CUDA; the same code runs on CPU in
tests) with ``torchcodec.decoders.decode_jpeg`` where torchcodec is installed and loads against this torch
(torchvision 0.29 deprecates its own decoders in its favour), else with ``torchvision.io.decode_jpeg``. Both give
libjpeg-turbo's pixels on CPU, equal to PIL's (tests/shards/test_torchcodec.py). torchcodec turns images upright
from their EXIF orientation itself; after torchvision's decoder that is done here from the tag the caller read.
Other formats, and JPEGs the batch decoder rejects, fall back to PIL per image.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from shards.errors import CorruptDataError, InputError
from shards.image.geometry import Box, center_crop_box, eval_resize_size
from shards.image.options import IMAGENET_MEAN, IMAGENET_STD, torchvision_mode

log = logging.getLogger(__name__)

JPEG_EXTENSIONS = frozenset({"jpg", "jpeg"})


def exif_orientation(data: bytes) -> int:
    """The EXIF orientation tag of an encoded image (1 when absent); parses the header only, decodes no pixels."""
    from shards.image.decode import JPEG_MAGIC, jpeg_orientation, open_image

    if data[:2] == JPEG_MAGIC:
        return jpeg_orientation(data)  # a few byte comparisons instead of opening the image with PIL
    try:
        return int(open_image(data).getexif().get(0x0112, 1))
    except Exception:  # a broken header is reported by the decoder itself, with the sample's key
        return 1


def apply_orientation(image: torch.Tensor, orientation: int) -> torch.Tensor:
    """Turn a decoded [C, H, W] image upright exactly as ``PIL.ImageOps.exif_transpose`` does."""
    if orientation == 2:
        return image.flip(-1)
    if orientation == 3:
        return image.flip(-1).flip(-2)
    if orientation == 4:
        return image.flip(-2)
    if orientation == 5:
        return image.transpose(-1, -2)
    if orientation == 6:
        return image.rot90(-1, dims=(-2, -1))
    if orientation == 7:
        return image.transpose(-1, -2).flip(-1).flip(-2)
    if orientation == 8:
        return image.rot90(1, dims=(-2, -1))
    return image


def _decode_one_cpu(data: bytes) -> torch.Tensor:
    from torchvision.transforms.functional import pil_to_tensor

    from shards.image.decode import decode_image

    return pil_to_tensor(decode_image(data))


@functools.cache
def _torchcodec_decode_jpeg() -> Callable | None:
    """torchcodec's ``decode_jpeg`` where it is installed and its libraries load against this torch, else None."""
    try:
        from torchcodec.decoders import decode_jpeg
    except (ImportError, OSError, RuntimeError) as exc:  # absent; or its .so was built for another torch
        log.debug("torchcodec is not usable here (%s: %s); JPEG batches decode with torchvision",
                  type(exc).__name__, exc)
        return None
    return decode_jpeg


def _decode_torchcodec(buffers: list[torch.Tensor], orientations: Sequence[int],
                       device: torch.device) -> list[torch.Tensor]:
    # Upright already: torchcodec applies the EXIF orientation itself, on CPU and on CUDA.
    return _torchcodec_decode_jpeg()(buffers, mode="RGB", device=device)


def _decode_torchvision(buffers: list[torch.Tensor], orientations: Sequence[int],
                        device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():
        # torchvision 0.29 deprecates its decoders in favour of torchcodec (vision#9609). Here they are the fallback
        # where torchcodec is not usable, and nvJPEG's way in then: that one notice is silenced for this call only.
        warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                                category=DeprecationWarning)
        images = decode_jpeg(buffers, mode=ImageReadMode.RGB, device=device)
    return [apply_orientation(image, orientation) for image, orientation in zip(images, orientations)]


JPEG_BACKENDS: dict[str, Callable[..., list[torch.Tensor]]] = {
    "torchcodec": _decode_torchcodec,
    "torchvision": _decode_torchvision,
}


def jpeg_backend() -> str:
    """The batch JPEG decoder this process uses: ``torchcodec`` where usable, else ``torchvision``."""
    return "torchcodec" if _torchcodec_decode_jpeg() is not None else "torchvision"


def _check_backend(backend: str | None) -> str:
    if backend is None:
        return jpeg_backend()
    if backend not in JPEG_BACKENDS:
        raise InputError(f"JPEG backend {backend!r} is unknown; choose one of {sorted(JPEG_BACKENDS)}")
    if backend == "torchcodec" and _torchcodec_decode_jpeg() is None:
        raise InputError("torchcodec is not installed or does not load with this torch "
                         "(pip install 'shardcache[integrations]')")
    return backend


def decode_images(datas: Sequence[bytes], exts: Sequence[str], orientations: Sequence[int],
                  device: torch.device | str, keys: Sequence[str] | None = None, *,
                  backend: str | None = None) -> list[torch.Tensor]:
    """Decode a batch to upright RGB uint8 [3, H, W] tensors on ``device``.

    ``backend`` names the batch JPEG decoder (``JPEG_BACKENDS``; None: ``jpeg_backend()``). An image neither it nor
    PIL can decode raises ``CorruptDataError``; its message names the sample's key when ``keys`` is given (and its
    position in the batch otherwise).
    """
    device = torch.device(device)
    decode_jpegs = JPEG_BACKENDS[_check_backend(backend)]
    out: list[torch.Tensor | None] = [None] * len(datas)
    jpeg_index = [i for i, ext in enumerate(exts) if ext.lower() in JPEG_EXTENSIONS]
    if jpeg_index:
        buffers = [torch.frombuffer(bytearray(datas[i]), dtype=torch.uint8) for i in jpeg_index]
        try:
            decoded = decode_jpegs(buffers, [orientations[i] for i in jpeg_index], device)
        except RuntimeError:
            decoded = [None] * len(jpeg_index)  # one bad or exotic JPEG fails the batch: retry per image below
        for i, image in zip(jpeg_index, decoded):
            out[i] = image
    for i, image in enumerate(out):
        if image is None:
            try:
                out[i] = _decode_one_cpu(datas[i]).to(device, non_blocking=True)
            except Exception as exc:  # PIL raises several types for damaged data
                where = "" if keys is not None else f" {i} of the batch"
                raise CorruptDataError(f"cannot decode image{where} ({type(exc).__name__}: {exc})",
                                       key=None if keys is None else keys[i]) from exc
    return out  # type: ignore[return-value]


def resize_center_crop(image: torch.Tensor, resize: int, crop: int, interpolation: str = "bilinear") -> torch.Tensor:
    """The eval geometry on a uint8 [3, H, W] tensor (any device, any strides): ``Resize(resize)`` (antialiased)
    then ``CenterCrop(crop)``, the sizes and box from ``shards.image.geometry``. Returns a view of the resized
    image; call ``.contiguous()`` to own the pixels."""
    import torchvision.transforms.v2.functional as F

    height, width = image.shape[-2:]
    size = eval_resize_size(int(width), int(height), resize)
    image = F.resize(image, list(size), interpolation=torchvision_mode(interpolation), antialias=True)
    return F.crop(image, *center_crop_box(size.width, size.height, crop))


def resized_crop(image: torch.Tensor, box: Box, size: int, flip: bool, interpolation: str = "bilinear") -> torch.Tensor:
    """One augmented view of a uint8 [3, H, W] tensor: crop ``box``, resize to size x size (antialiased),
    mirror when ``flip``."""
    import torchvision.transforms.v2.functional as F

    image = F.resized_crop(image, *box, [size, size], interpolation=torchvision_mode(interpolation), antialias=True)
    return image.flip(-1) if flip else image


class Normalize(nn.Module):
    """uint8 [B, 3, H, W] -> normalised float batch, on whatever device the batch is on.

    One cast and one fused multiply-add per element (``x * 1/(255 std) - mean/std``): the same values as
    ``ToTensor`` + ``Normalize`` to within 1e-6, at half the cost of four passes over a float batch, which matters
    when the consumer is a CPU. ``dtype`` and ``channels_last`` set the model's input layout; the layout is chosen
    on the uint8 batch, before the four-times-larger float copy exists.
    """

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD, *,
                 dtype: torch.dtype = torch.float32, channels_last: bool = False):
        super().__init__()
        mean_t = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.register_buffer("scale", 1.0 / (255.0 * std_t), persistent=False)
        self.register_buffer("shift", -mean_t / std_t, persistent=False)
        self.dtype = dtype
        self.channels_last = channels_last

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.is_floating_point():  # already normalised by a standard transform: pass through
            return images
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        out = images.to(torch.float32).mul_(self.scale).add_(self.shift)
        return out if self.dtype == torch.float32 else out.to(self.dtype)
