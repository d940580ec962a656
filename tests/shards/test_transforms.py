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
    with pytest.raises(InputError, match="crop size 64 must be at least 1 and at most the resize 48"):
        TransformSpec(size=64, resize_size=48)
    for mean, std in (((0.5, 0.5), (0.2, 0.2, 0.2)), ((0.5, 0.5, 0.5), (0.2, 0.0, 0.2))):
        with pytest.raises(InputError, match="three values each, std positive"):
            TransformSpec(mean=mean, std=std)


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


def photo(size=(160, 120)):
    rng = np.random.default_rng(1)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest"])
def test_eval_preset_gives_torchvision_pixels_exactly(interpolation):
    import torchvision.transforms as T

    spec = TransformSpec(preset="eval", size=64, resize_size=80, interpolation=interpolation)
    mode = T.InterpolationMode(interpolation)
    reference = T.Compose([T.Resize(80, interpolation=mode), T.CenterCrop(64), T.ToTensor(),
                           T.Normalize(spec.mean, spec.std)])
    for size in ((160, 120), (120, 160), (97, 97)):
        assert torch.equal(build_transform(spec)(photo(size)), reference(photo(size)))


def test_train_preset_draws_only_from_its_seed_with_the_fast_paths_box():
    import torchvision.transforms.functional as TF

    from shards.image.fast import FastTrain

    spec = TransformSpec(preset="train", size=48)
    transform, image = build_transform(spec), photo()
    state = torch.get_rng_state()
    first, again, other = transform(image, seed=5), transform(image, seed=5), transform(image, seed=6)
    assert torch.equal(torch.get_rng_state(), state)  # no global random state read or advanced
    assert torch.equal(first, again) and not torch.equal(first, other)
    box, flip = FastTrain(size=48).view(image.width, image.height, 5)
    view = TF.resized_crop(image, *box, [48, 48])
    reference = TF.normalize(TF.to_tensor(TF.hflip(view) if flip else view), spec.mean, spec.std)
    assert torch.equal(first, reference)
    jitter = train_transform(48, color_jitter=0.4)
    assert torch.equal(jitter(image, 3), jitter(image, 3)) and not torch.equal(jitter(image, 3), first)


def test_train_preset_without_a_seed_follows_torchs_global_generator():
    transform, image = train_transform(48), photo()
    torch.manual_seed(1)
    first, second = transform(image), transform(image)
    torch.manual_seed(1)
    assert torch.equal(transform(image), first) and not torch.equal(first, second)


def test_decoder_seeds_a_user_callable_and_restores_the_global_generator():
    from shards.formats.sample import RawSample

    sample = RawSample("k", jpeg(), "jpg", 0)
    decoder = ImageDecoder(lambda image: torch.rand(3))
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, again, other = decoder(sample, 7), decoder(sample, 7), decoder(sample, 8)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first, again) and not torch.equal(first, other)
    preset = ImageDecoder(train_transform(32))
    assert torch.equal(preset(sample, 7), train_transform(32)(decode_image(sample.data), 7))
    assert ImageDecoder(eval_transform(16))(sample).shape == (3, 16, 16)  # seed defaults to 0
