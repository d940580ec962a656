"""The fast path gives the reference pipeline's pixels (within a gray level) as uint8, normalised per batch."""

import io
import random

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from shards import fast
from shards.fast import FastEval, FastTrain, Normalize, decode_rgb_array, jpeg_orientation


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth structure plus noise: closer to a photo than flat colour, so resampling differences show."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, width)[None, :, None]
    y = np.linspace(0, 1, height)[:, None, None]
    base = (np.sin(x * rng.uniform(3, 9)) * np.cos(y * rng.uniform(3, 9)) + 1) * 120 * rng.uniform(0.4, 1, 3)
    return Image.fromarray((base + rng.normal(0, 10, (height, width, 3))).clip(0, 255).astype("uint8"))


def jpeg_bytes(image: Image.Image, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90, **kwargs)
    return buffer.getvalue()


REFERENCE = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])


@pytest.mark.parametrize("size", [(500, 375), (375, 500), (300, 300), (1200, 900)])
def test_eval_matches_torchvision_within_one_gray_level(size):
    data = jpeg_bytes(photo(*size))
    reference = REFERENCE(Image.open(io.BytesIO(data)).convert("RGB")).float()
    out = FastEval()(data)
    assert out.dtype == torch.uint8 and out.shape == (3, 224, 224)
    assert (out.float() - reference).abs().mean().item() < 1.0


def test_eval_without_draft_is_nearly_exact():
    data = jpeg_bytes(photo(1200, 900, seed=3))
    reference = REFERENCE(Image.open(io.BytesIO(data)).convert("RGB")).float()
    assert (FastEval(draft=False)(data).float() - reference).abs().mean().item() < 0.1


def test_draft_decodes_large_jpeg_smaller_but_not_below_target():
    data = jpeg_bytes(photo(1200, 900))
    array = decode_rgb_array(data, min_size=256)
    assert min(array.shape[:2]) >= 256 and array.shape[1] < 1200


def test_exif_rotation_and_non_jpeg_modes_are_applied():
    image = photo(400, 300)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise when shown
    data = jpeg_bytes(image, exif=exif.tobytes())
    assert jpeg_orientation(data) == 6
    assert decode_rgb_array(data).shape[:2] == (400, 300)
    buffer = io.BytesIO()
    image.convert("LA").save(buffer, format="PNG")
    assert decode_rgb_array(buffer.getvalue()).shape == (300, 400, 3)


def test_pil_fallback_gives_same_pixels(monkeypatch):
    data = jpeg_bytes(photo(500, 375))
    with_fast_decoder = FastEval()(data)
    monkeypatch.setattr(fast, "simplejpeg", None)
    assert (FastEval()(data).float() - with_fast_decoder.float()).abs().mean().item() < 0.5


def test_train_crop_is_seeded_and_valid():
    data = jpeg_bytes(photo(500, 375))
    transform = FastTrain(size=96)
    first, again, other = transform(data, seed=7), transform(data, seed=7), transform(data, seed=8)
    assert first.shape == (3, 96, 96) and first.dtype == torch.uint8
    assert torch.equal(first, again) and not torch.equal(first, other)
    rng = random.Random(0)
    for _ in range(200):
        left, top, right, bottom = transform.crop_box(500, 375, rng)
        assert 0 <= left < right <= 500 and 0 <= top < bottom <= 375


def test_normalize_equals_to_tensor_plus_normalize():
    batch = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    reference = T.Normalize(fast.IMAGENET_MEAN, fast.IMAGENET_STD)(batch.float() / 255)
    out = Normalize()(batch)
    assert out.dtype == torch.float32
    assert torch.allclose(out, reference, atol=1e-5)
    assert Normalize(dtype=torch.bfloat16)(batch).dtype == torch.bfloat16
    assert torch.equal(Normalize()(reference), reference)  # float input passes through
