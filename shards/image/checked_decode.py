"""Device decoding that proves its pixels: a seeded sample of each batch decoded again on the CPU and compared.

Batched nvJPEG decoding through torchcodec and torchvision has silently returned wrong pixels on H100s
(torchcodec#1634, vision#9606): a run on such a build would write features of garbage with exit 0. So a fixed,
seeded share of the images (1 in ``every``, chosen from each sample's key, never from timing: the same images are
checked on every run) is decoded a second time by the CPU reference decoder (PIL, libjpeg-turbo) and compared. A
shape that differs, or a mean difference beyond ``tolerance`` grey levels (nvJPEG's IDCT differs from libjpeg-turbo's
by well under one on photos), turns device decoding off for the rest of the run: one warning line names the image
and the difference, ``failure`` keeps it for the run record, and every later batch, that one included, is decoded on
the CPU and moved to the device. What was already decoded and checked before stays: the check is a sample, so it
bounds how long a broken decoder goes unnoticed (on average ``every`` images), it does not prove each image.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from shards.errors import InputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeCheck:
    """How device decoding is checked: 1 in ``every`` images (0: never), chosen by ``seed``; ``tolerance`` is the
    largest mean absolute difference, in grey levels, between the device's pixels and the CPU's."""

    every: int = 256
    seed: int = 0
    tolerance: float = 2.0

    def __post_init__(self) -> None:
        if self.every < 0:
            raise InputError(f"decode check: every must be >= 0 (0 turns the check off), got {self.every}")
        if not self.tolerance > 0:
            raise InputError(f"decode check: tolerance must be > 0 grey levels, got {self.tolerance}")

    def picks(self, key: str) -> bool:
        """Whether the image ``key`` is checked: a fixed function of the key and seed."""
        if self.every == 0:
            return False
        digest = hashlib.blake2b(f"{self.seed}\0{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.every == 0


Decode = Callable[..., list[torch.Tensor]]


def device_decode(datas: Sequence[bytes], exts: Sequence[str], orientations: Sequence[int], device: torch.device,
                  keys: Sequence[str] | None = None) -> list[torch.Tensor]:
    """The batch decoder that is checked (``shards.image.device.decode_images``); a test replaces it by name with
    one made to corrupt."""
    from shards.image.device import decode_images

    return decode_images(datas, exts, orientations, device, keys=keys)


def _cpu_reference(data: bytes) -> torch.Tensor:
    from torchvision.transforms.functional import pil_to_tensor

    from shards.image.decode import decode_image

    return pil_to_tensor(decode_image(data))


@dataclass
class CheckedDecoder:
    """``decode_images`` on ``device`` under a ``DecodeCheck``; after a failed check, the CPU decodes instead.

    ``decode`` is the device decoder (None: ``device_decode``; tests pass one made to corrupt);
    ``reference`` decodes one image's bytes on the CPU to uint8 [3, H, W], upright.
    """

    device: torch.device
    check: DecodeCheck = DecodeCheck()
    decode: Decode | None = None
    reference: Callable[[bytes], torch.Tensor] = _cpu_reference
    checked: int = 0
    failure: str | None = None
    worst: float = 0.0
    _cpu_device: torch.device = field(default=torch.device("cpu"), repr=False)

    def __call__(self, datas: Sequence[bytes], exts: Sequence[str], orientations: Sequence[int],
                 keys: Sequence[str]) -> list[torch.Tensor]:
        if self.failure is not None:
            return self._on_cpu(datas, exts, orientations, keys)
        decode = self.decode or device_decode
        images = decode(datas, exts, orientations, self.device, keys=keys)
        for i, key in enumerate(keys):
            if self.check.picks(key) and not self._agrees(key, datas[i], images[i]):
                return self._on_cpu(datas, exts, orientations, keys)
        return images

    def _agrees(self, key: str, data: bytes, image: torch.Tensor) -> bool:
        expected = self.reference(data)
        self.checked += 1
        if tuple(expected.shape) != tuple(image.shape):
            why = f"shape {tuple(image.shape)} where the CPU decodes {tuple(expected.shape)}"
        else:
            difference = float((image.to(self._cpu_device).float() - expected.float()).abs().mean())
            self.worst = max(self.worst, difference)
            if difference <= self.check.tolerance:
                return True
            why = f"mean difference {difference:.1f} grey levels (tolerance {self.check.tolerance})"
        self.failure = f"image {key!r}: {why}"
        log.warning("device decoding on %s gave wrong pixels for %s; decoding on the CPU for the rest of the run",
                    self.device, self.failure)
        return False

    def _on_cpu(self, datas: Sequence[bytes], exts: Sequence[str], orientations: Sequence[int],
                keys: Sequence[str]) -> list[torch.Tensor]:
        """The batch decoded by the CPU (libjpeg-turbo through the same batch decoder), moved to the device."""
        from shards.image.device import decode_images

        images = decode_images(datas, exts, orientations, self._cpu_device, keys=keys)
        return [image.to(self.device, non_blocking=True) for image in images]

    def record(self) -> dict:
        """What the run record keeps of the check."""
        return {"every": self.check.every, "seed": self.check.seed, "tolerance": self.check.tolerance,
                "checked": self.checked, "worst_mean_difference": round(self.worst, 3), "failure": self.failure}
