"""Device-side image work: batched decode equals PIL's, EXIF orientation as PIL applies it, exact normalisation."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from shards.image.decode import decode_image
from shards.image.device import Normalize, apply_orientation, decode_images, exif_orientation
from shards.errors import CorruptDataError
from tests.helpers import class_image


def _with_orientation(orientation: int) -> bytes:
    image = Image.open(io.BytesIO(class_image(1, 3, size=(20, 12))))
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95, exif=exif)
    return buffer.getvalue()


def _pil_tensor(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(decode_image(data)).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_batched_decode_applies_exif_orientation_like_pil(orientation):
    data = _with_orientation(orientation)
    assert exif_orientation(data) == orientation
    [decoded] = decode_images([data], ["jpg"], [orientation], "cpu")
    assert torch.equal(decoded, _pil_tensor(data))


def test_non_jpeg_falls_back_to_pil_and_keeps_batch_order():
    datas = [class_image(0, 1, fmt="PNG"), class_image(2, 2), class_image(1, 5, fmt="WEBP")]
    decoded = decode_images(datas, ["png", "jpg", "webp"], [1, 1, 1], "cpu")
    assert [d.shape for d in decoded] == [(3, 40, 48)] * 3
    for data, image in zip(datas, decoded):
        assert torch.equal(image, _pil_tensor(data))


def test_undecodable_bytes_name_the_sample():
    with pytest.raises(CorruptDataError, match=r"^\[sample k2\]: cannot decode image \(") as info:
        decode_images([class_image(0, 0), b"not an image"], ["jpg", "jpg"], [1, 1], "cpu", keys=["k1", "k2"])
    assert info.value.key == "k2" and "k1" not in str(info.value)
    with pytest.raises(CorruptDataError, match=r"^cannot decode image 1 of the batch \("):
        decode_images([class_image(0, 0), b"not an image"], ["jpg", "png"], [1, 1], "cpu")


def test_tensor_geometry_matches_torchvision_on_pil_images():
    import torchvision.transforms.functional as TF

    from shards.image.device import resize_center_crop, resized_crop
    from shards.image.geometry import Box

    data = class_image(2, 4, size=(90, 61))
    image = decode_image(data)
    tensor = _pil_tensor(data)
    reference = TF.pil_to_tensor(T.Compose([T.Resize(40), T.CenterCrop(32)])(image))
    assert (resize_center_crop(tensor, 40, 32).float() - reference.float()).abs().mean() < 1.0
    box = Box(top=5, left=7, height=30, width=50)
    view = resized_crop(tensor, box, 24, flip=True)
    reference = TF.pil_to_tensor(TF.hflip(TF.resized_crop(image, *box, [24, 24])))
    assert view.shape == (3, 24, 24) and (view.float() - reference.float()).abs().mean() < 1.0


def test_normalize_matches_to_tensor_and_normalize():
    images = torch.randint(0, 256, (2, 3, 5, 7), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    reference = torch.stack([T.Normalize(mean, std)(img.float() / 255) for img in images])
    out = Normalize(mean, std, channels_last=True)(images)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out, reference, atol=1e-6)
    assert torch.equal(apply_orientation(images[0], 1), images[0])
