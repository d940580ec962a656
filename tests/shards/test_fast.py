"""The fast path gives the reference pipeline's pixels (within a gray level) as uint8, normalised per batch."""

import io

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from PIL import Image

from shards.image import fast
from shards.image.fast import FastEval, FastTrain, Normalize, decode_rgb_array, jpeg_orientation
from shards.loader.worker_processes import WorkerProcesses


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


@pytest.mark.parametrize("size, decoded", [((490, 402), (402, 490)), ((980, 804), (402, 490)), ((2000, 1100), (275, 500))])
@pytest.mark.slow  # over half a second in the quick loop
def test_dct_scaling_stops_at_halvings(size, decoded):
    """libjpeg-turbo also scales by 3/4, 5/8, ...; on x86 those IDCTs have no SIMD (they cost more CPU than a full
    decode) and their pixels sit 1.4-3.8 gray levels from the reference (scripts/bench/decode.py): 1/2, 1/4, 1/8
    only, as PIL's draft."""
    assert decode_rgb_array(jpeg_bytes(photo(*size)), min_size=256).shape[:2] == decoded


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
    for seed in range(200):
        box, _ = transform.view(500, 375, seed)
        assert 0 <= box.left < box.right <= 500 and 0 <= box.top < box.bottom <= 375


def test_fast_decoder_draws_only_from_the_seed_it_is_given():
    from shards.formats.sample import RawSample
    from shards.image.transforms import TransformSpec

    sample = RawSample("k", jpeg_bytes(photo(200, 150)), "jpg", 0)
    decoder = fast.FastDecoder(TransformSpec(preset="train", size=48))
    state = torch.get_rng_state()
    first, again, other = decoder(sample, 11), decoder(sample, 11), decoder(sample, 12)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is neither read nor advanced
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(first, FastTrain(size=48)(sample.data, 11))


def test_normalize_equals_to_tensor_plus_normalize():
    batch = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    reference = T.Normalize(fast.IMAGENET_MEAN, fast.IMAGENET_STD)(batch.float() / 255)
    out = Normalize()(batch)
    assert out.dtype == torch.float32
    assert torch.allclose(out, reference, atol=1e-5)
    assert Normalize(dtype=torch.bfloat16)(batch).dtype == torch.bfloat16
    assert torch.equal(Normalize()(reference), reference)  # float input passes through


def test_fast_pipeline_streams_uint8_matching_the_standard_pipeline(tmp_path):
    import shards
    from tests.helpers import make_shard_dataset

    make_shard_dataset(tmp_path, size=(120, 90))
    spec = shards.TransformSpec(preset="eval", size=64)
    fast_set = shards.open_dataset(tmp_path, "val", transform=spec, decode=shards.Decode("fast"), return_keys=True,
                                   sampling=shards.Sampling(shuffle=False))
    standard_set = shards.open_dataset(tmp_path, "val", transform=spec, return_keys=True,
                                       sampling=shards.Sampling(shuffle=False))
    fast_rows, standard_rows = list(fast_set), list(standard_set)
    assert [r[2] for r in fast_rows] == [r[2] for r in standard_rows]
    assert [r[1] for r in fast_rows] == [r[1] for r in standard_rows]
    batch = torch.stack([r[0] for r in fast_rows])
    assert batch.dtype == torch.uint8 and batch.shape[1:] == (3, 64, 64)
    normalized = fast_set.normalizer()(batch)
    reference = torch.stack([r[0] for r in standard_rows])
    assert (normalized - reference).abs().mean().item() < 1.0 / (255 * 0.225)


@pytest.mark.slow  # over half a second in the quick loop
def test_fast_train_pipeline_replays_with_the_same_seed_and_changes_with_another(tmp_path):
    import shards
    from tests.helpers import make_shard_dataset

    make_shard_dataset(tmp_path, size=(80, 60))
    spec = shards.TransformSpec(preset="train", size=32)
    runs = []
    for seed in (3, 3, 4):
        dataset = shards.open_dataset(tmp_path, "train", transform=spec, decode=shards.Decode("fast"), seed=seed,
                                      return_keys=True, sampling=shards.Sampling(shuffle=False))
        loader = shards.make_loader(dataset, batch_size=4, mode=WorkerProcesses(2, persistent=False), drop_last=False)
        runs.append({key: image for images, _, keys in loader for key, image in zip(keys, images)})
    assert runs[0].keys() == runs[1].keys() == runs[2].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not all(torch.equal(runs[0][k], runs[2][k]) for k in runs[0])


def test_fast_pipeline_refuses_what_it_cannot_do(tmp_path):
    import shards
    from shards.errors import InputError
    from tests.helpers import make_shard_dataset

    make_shard_dataset(tmp_path)
    with pytest.raises(InputError, match="ColorJitter"):
        shards.open_dataset(tmp_path, transform=shards.TransformSpec(preset="train", color_jitter=0.4),
                            decode=shards.Decode("fast"))
    with pytest.raises(InputError, match="callable"):
        shards.open_dataset(tmp_path, transform=lambda image: image, decode=shards.Decode("fast"))


def test_train_crop_matches_torchvision_resized_crop_within_one_gray_level():
    import torchvision.transforms.functional as TF

    data = jpeg_bytes(photo(500, 375))
    transform = FastTrain(size=96, hflip=0.0)
    for seed in range(4):
        box, flip = transform.view(500, 375, seed)
        assert not flip
        source = Image.open(io.BytesIO(data)).convert("RGB")
        reference = TF.pil_to_tensor(TF.resized_crop(source, *box, [96, 96]))
        assert (transform(data, seed).float() - reference.float()).abs().mean().item() < 1.0


def test_pil_path_gives_decode_image_pixels_and_still_turns_rotated_jpegs(monkeypatch):
    from shards.image.decode import decode_image

    monkeypatch.setattr(fast, "simplejpeg", None)
    data = jpeg_bytes(photo(400, 300))
    assert np.array_equal(decode_rgb_array(data), np.asarray(decode_image(data)))
    assert np.array_equal(decode_rgb_array(data, 100), np.asarray(decode_image(data, draft_size=(100, 100))))
    exif = Image.Exif()
    exif[0x0112] = 6
    assert decode_rgb_array(jpeg_bytes(photo(400, 300), exif=exif.tobytes())).shape == (400, 300, 3)


@pytest.mark.parametrize("interpolation", ["bicubic", "nearest"])
def test_other_interpolations_keep_the_pil_path(interpolation):
    data = jpeg_bytes(photo(500, 375))
    out = FastEval(interpolation=interpolation)(data)
    reference = T.Compose([T.Resize(256, interpolation=T.InterpolationMode(interpolation)), T.CenterCrop(224),
                           T.PILToTensor()])(Image.open(io.BytesIO(data)).convert("RGB"))
    assert out.shape == (3, 224, 224) and (out.float() - reference.float()).abs().mean().item() < 1.0
    assert FastTrain(size=64, interpolation=interpolation)(data, seed=1).shape == (3, 64, 64)
