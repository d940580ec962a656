"""Transform presets and fast decode: shapes, ImageNet statistics, validation, and what draft decoding costs."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from shards.image.decode import ImageDecoder, decode_image
from shards.errors import CorruptDataError, InputError
from shards.image.transforms import IMAGENET_MEAN, TransformSpec, build_transform, eval_transform, train_transform


def jpeg(size=(400, 300)):
    x = np.linspace(0, 255, size[0], dtype=np.float32)
    y = np.linspace(0, 255, size[1], dtype=np.float32)[:, None]
    array = np.stack([x + 0 * y, y + 0 * x, (x + y) / 2], axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=92)
    return buffer.getvalue()


def test_presets_give_normalised_tensors_of_the_asked_size():
    image = Image.new("RGB", (90, 70), tuple(int(m * 255) for m in IMAGENET_MEAN))
    out = eval_transform(32)(image)
    assert out.shape == (3, 32, 32) and out.abs().max() < 0.05
    torch.manual_seed(0)
    assert train_transform(24, color_jitter=0.4)(image).shape == (3, 24, 24)
    assert build_transform("eval", size=16, resize_size=20)(image).shape == (3, 16, 16)


def test_spec_round_trip_and_validation():
    spec = TransformSpec(preset="train", size=160, color_jitter=0.2)
    assert TransformSpec.from_dict(spec.to_dict()) == spec
    assert TransformSpec(size=224).eval_resize == 256 and TransformSpec(size=224).draft_size == (256, 256)
    with pytest.raises(InputError, match="preset"):
        TransformSpec(preset="fancy")
    with pytest.raises(InputError, match="unknown transform fields"):
        TransformSpec.from_dict({"sise": 3})


def test_draft_decode_is_smaller_and_close_after_the_eval_transform():
    data = jpeg((1024, 768))
    assert decode_image(data, draft_size=(256, 256)).size == (512, 384)
    transform = eval_transform(224)
    full = transform(decode_image(data))
    drafted = transform(decode_image(data, draft_size=(256, 256)))
    std = torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    gray_levels = ((full - drafted) * std * 255).abs().mean()
    assert gray_levels < 2.0


def test_decoder_turns_bad_bytes_into_corrupt_data_error():
    decoder = ImageDecoder(eval_transform(16))
    with pytest.raises(CorruptDataError, match="cannot decode"):
        decoder.decode(b"\xff\xd8 broken", "jpg")
    truncated = jpeg()[:600]
    with pytest.raises(CorruptDataError):
        decoder.decode(truncated, "jpg")


def test_every_mode_becomes_rgb():
    for mode in ("L", "RGBA", "P", "CMYK"):
        buffer = io.BytesIO()
        Image.new(mode, (8, 8)).save(buffer, format="PNG" if mode != "CMYK" else "JPEG")
        assert ImageDecoder().decode(buffer.getvalue()).mode == "RGB"
