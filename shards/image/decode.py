"""Decoding encoded image bytes to RGB, with no I/O and no randomness.

Every mode becomes RGB the way a user expects: EXIF orientation applied; alpha composited on white (not dropped
to black); palette and 16-bit images converted through their proper paths; CMYK through PIL's conversion.
"""

from __future__ import annotations

import contextlib
import io
import random
import threading
from typing import Iterator

from PIL import Image, ImageOps

from shards.procs.decode_mark import mark_decoded

# A transform that draws from torch's global generator seeds it per sample: one thread at a time per process.
_GLOBAL_GENERATOR = threading.Lock()

JPEG_MAGIC = b"\xff\xd8"

# Decompression-bomb guard: PIL raises above twice this; we keep its default unless the caller says otherwise.
DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to RGB correctly (alpha over white, 16-bit scaled, palette expanded)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16-bit grayscale: scale to 8 bits instead of clipping everything above 255 to white.
        import numpy as np

        array = np.asarray(image, dtype=np.uint32 if image.mode == "I" else np.uint16).astype("float32")
        peak = 65535.0 if image.mode != "I" or array.max() > 255 else 255.0
        array = (array * (255.0 / peak)).round().clip(0, 255).astype("uint8")
        return Image.fromarray(array, mode="L").convert("RGB")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def open_image(data: bytes) -> Image.Image:
    """Open without decoding pixels yet (so callers can ``draft`` a JPEG before the decode)."""
    return Image.open(io.BytesIO(data))


def decode_image(data: bytes, *, draft_size: tuple[int, int] | None = None) -> Image.Image:
    """Decode to an RGB image with EXIF orientation applied.

    ``draft_size`` lets the JPEG decoder scale by 1/2, 1/4 or 1/8 while decoding, keeping the result at least
    that large: much faster when the stored image is far bigger than what the transform needs.
    """
    image = open_image(data)
    orientation = image.getexif().get(0x0112, 1)  # header only: no pixels decoded yet
    if draft_size is not None and image.format == "JPEG":
        width, height = draft_size
        if orientation in (5, 6, 7, 8):  # rotated 90 degrees: the stored image is transposed
            width, height = height, width
        image.draft("RGB", (width, height))
    if orientation != 1:  # exif_transpose copies the whole image even when nothing turns
        image = ImageOps.exif_transpose(image)
    return to_rgb(image)


@contextlib.contextmanager
def _seeded_python_and_numpy(seed: int, restore: bool) -> Iterator[None]:
    """Python's ``random`` and NumPy's global generator seeded to the sample's ``seed`` for the block: transforms
    written for albumentations or by hand draw from them, not from torch's. Unseeded, a resumed epoch fed other
    augmentations than an uninterrupted one (the keys matched, the pixels did not).

    ``restore``: put the caller's states back after (the training process, ``InProcess``, where the transform
    moved them): about 90 us a sample, NumPy's state copy most of it; a worker process only seeds, about 6 us."""
    import numpy as np

    states = (random.getstate(), np.random.get_state()) if restore else None
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        if states is not None:
            random.setstate(states[0])
            np.random.set_state(states[1])


class ImageDecoder:
    """The decode stage of the streaming reader: ``(RawSample, seed)`` -> RGB image -> ``transform``.

    A plain picklable object so DataLoader workers can carry it; other decoders (uint8 tensors, batch-level
    ones) replace it without touching the reader. Undecodable bytes raise ``CorruptDataError`` so the reader's
    ``on_error`` policy, not the decoder, decides what happens.

    ``seed`` is the sample's augmentation seed from the reader. A preset's ``PilTransform`` takes it directly; any
    other callable (a torchvision pipeline draws from torch's global generator) runs with torch's CPU generator
    seeded to it inside ``torch.random.fork_rng``, so the caller's random state is the same afterwards. That
    generator is the process's: threads of one worker process take turns at it (``_GLOBAL_GENERATOR``), and the
    thread run mode, whose threads share it with the training step, refuses a transform that draws from it
    (``draws_from_global_generator``); one its probe saw draw nothing runs there untouched (``draws_nothing``).

    Each call marks where it finished decoding and began transforming (``shards.procs.stage_times.mark_decoded``):
    the reader's stage timing splits the call there.
    """

    def __init__(self, transform=None, *, draft_size: tuple[int, int] | None = None):
        self.transform = transform
        self.draft_size = draft_size
        # Set by the loader's probe (``shards.stream.transform_probe``) when the transform drew from no global
        # generator on the dataset's first samples: the training process then calls it as it is (threads run it
        # beside the training step, whose generator it must not touch); a worker process still seeds it per sample.
        self.draws_nothing = False

    def decode(self, data: bytes, ext: str = "") -> Image.Image:
        from shards.errors import CorruptDataError

        try:
            image = decode_image(data, draft_size=self.draft_size)
            image.load()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
            raise CorruptDataError(f"cannot decode .{ext} image ({type(exc).__name__}: {exc})") from exc
        return image

    def __call__(self, sample, seed: int = 0):
        image = self.decode(sample.data, sample.ext)
        mark_decoded()
        if self.transform is None:
            return image
        import torch
        from torch.utils.data import get_worker_info

        from shards.image.transforms import PilTransform

        if isinstance(self.transform, PilTransform):
            return self.transform(image, seed)
        here = get_worker_info() is None  # the training process: its random states are the caller's
        if self.draws_nothing and here:
            return self.transform(image)
        with _GLOBAL_GENERATOR, torch.random.fork_rng(devices=[]), _seeded_python_and_numpy(seed, restore=here):
            # The CPU generator only: torch.manual_seed would also reseed CUDA, which fork_rng(devices=[]) leaves.
            torch.default_generator.manual_seed(seed)
            return self.transform(image)

    @property
    def draws_from_global_generator(self) -> bool:
        """Whether the transform may draw from torch's global generator (a callable that is not a preset's, unless
        the loader's probe saw it draw nothing)."""
        from shards.image.transforms import PilTransform

        return self.transform is not None and not isinstance(self.transform, PilTransform) and not self.draws_nothing


def jpeg_orientation(data: bytes) -> int:
    """EXIF orientation of a JPEG from its APP1 segment (1 when absent), without decoding anything."""
    pos, end = 2, min(len(data), 1 << 16)
    while pos + 4 <= end and data[pos] == 0xFF:
        marker = data[pos + 1]
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker == 0xE1 and data[pos + 4 : pos + 10] == b"Exif\x00\x00":
            return _tiff_orientation(data[pos + 10 : pos + 2 + length])
        if marker in (0xDA, 0xD9):  # start of scan / end of image: no EXIF before the pixels
            break
        pos += 2 + length
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(tiff):
            break
        if int.from_bytes(tiff[entry : entry + 2], order) == 0x0112:
            return int.from_bytes(tiff[entry + 8 : entry + 10], order) or 1
    return 1
