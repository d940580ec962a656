"""precompute-features describes its transform with the library's one spec type and assembles it with the library's
PIL steps: its uint8 inputs are the standard pipeline's pixels, and features.json records the eval transform exactly
(resize, crop, normalisation, filter), in the form every existing feature folder's config hash was computed from."""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from preprocess.features.featurize import resolve_transform
from preprocess.features.state import config_hash
from preprocess.features.transforms import AugmentSpec, eval_pil, transform_record, view_params, views_pil
from shards.errors import InputError
from shards.image.options import IMAGENET_MEAN, IMAGENET_STD
from shards.image.transforms import TransformSpec, build_transform, crop_view


@dataclasses.dataclass
class Cfg:
    resize: int | None = None
    crop: int | None = None
    mean: tuple | None = None
    std: tuple | None = None
    interpolation: str | None = None


@dataclasses.dataclass
class Weights:
    name: str = "resnet18"
    eval_preset: dict | None = None
    input_size: int | None = None


def photo(size=(150, 110)):
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def test_the_transform_is_the_library_spec_and_options_override_the_weights_preset():
    preset = {"resize": 232, "crop": 224, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25],
              "interpolation": "bicubic"}
    spec = resolve_transform(Cfg(crop=112), Weights(eval_preset=preset))
    assert spec == TransformSpec(preset="eval", size=112, resize_size=116, mean=(0.5, 0.5, 0.5),
                                 std=(0.25, 0.25, 0.25), interpolation="bicubic")  # the preset's resize/crop ratio
    assert resolve_transform(Cfg(), Weights()) == TransformSpec(preset="eval", size=224, resize_size=256)
    with pytest.raises(InputError, match="takes 224px inputs only; --crop is 112"):
        resolve_transform(Cfg(crop=112), Weights(name="vit_b_16", input_size=224))
    with pytest.raises(InputError, match="three values each"):
        resolve_transform(Cfg(std=(0.2, 0.0, 0.2)), Weights())


def test_the_recorded_transform_and_its_hash_stay_what_they_were():
    spec = resolve_transform(Cfg(), Weights())
    record = transform_record(spec)
    assert record == {"resize": 256, "crop": 224, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
                      "interpolation": "bilinear"}
    assert config_hash({"transform": record}) == "bdb3d60ffea04cef"  # existing folders stay current
    # Fields the eval transform does not use are not part of what it records.
    assert transform_record(dataclasses.replace(spec, scale=(0.5, 1.0), hflip=0.0)) == record
    assert transform_record(dataclasses.replace(spec, resize_size=240))["resize"] == 240


@pytest.mark.parametrize("size", [(150, 110), (110, 150), (97, 97)])
def test_uint8_eval_inputs_are_the_standard_pipelines_pixels(size):
    spec = TransformSpec(preset="eval", size=64, resize_size=80, mean=(0.4, 0.5, 0.6), std=(0.2, 0.3, 0.25))
    pixels = eval_pil(photo(size), spec)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 64, 64)
    normalised = (pixels.float() / 255 - torch.tensor(spec.mean)[:, None, None]) / torch.tensor(spec.std)[:, None, None]
    assert torch.allclose(normalised, build_transform(spec)(photo(size)), atol=1e-6)


def test_augmented_views_are_the_librarys_crop_views_of_the_same_spec():
    spec = TransformSpec(preset="eval", size=48, resize_size=56)
    augment = AugmentSpec(views=3, seed=7)
    image = photo()
    views = views_pil(image, spec, augment, "sample-1")
    assert views.shape == (3, 3, 48, 48) and views.dtype == torch.uint8
    for view in range(3):
        box, flip = view_params(augment, "sample-1", view, image.width, image.height)
        expected = np.asarray(crop_view(image, box, flip, spec)).transpose(2, 0, 1)
        assert torch.equal(views[view], torch.from_numpy(np.ascontiguousarray(expected)))
    assert not torch.equal(views[0], views[1])  # each view draws its own box
