"""A device decoder that returns wrong pixels is caught by the seeded CPU re-decode and replaced for the run."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from shards.errors import InputError
from shards.image.checked_decode import CheckedDecoder, DecodeCheck
from shards.image.device import decode_images


def jpegs(count: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        pixels = np.repeat(np.repeat(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8), 8, 0), 8, 1)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
        out.append(buffer.getvalue())
    return out


class Corrupting:
    """decode_images, but images from the ``after``-th call on come back inverted (what a broken nvJPEG does)."""

    def __init__(self, after: int = 0):
        self.calls, self.after = 0, after

    def __call__(self, datas, exts, orientations, device, keys=None):
        self.calls += 1
        images = decode_images(datas, exts, orientations, device, keys=keys)
        return [255 - image for image in images] if self.calls > self.after else images


def batch(datas, start):
    keys = [f"k{start + i:04d}" for i in range(len(datas))]
    return datas, ["jpg"] * len(datas), [1] * len(datas), keys


def test_a_healthy_decoder_passes_its_checks_and_keeps_the_device():
    datas = jpegs(8)
    checked = CheckedDecoder(torch.device("cpu"), DecodeCheck(every=2, seed=0))
    images = checked(*batch(datas, 0))
    assert checked.failure is None and checked.checked >= 1
    assert checked.worst <= 0.5
    assert all(torch.equal(a, b) for a, b in zip(images, decode_images(datas, ["jpg"] * 8, [1] * 8, "cpu")))


def test_a_corrupting_decoder_is_caught_and_the_batch_and_the_rest_are_decoded_on_the_cpu(caplog):
    datas = jpegs(8)
    corrupting = Corrupting(after=1)
    checked = CheckedDecoder(torch.device("cpu"), DecodeCheck(every=1, seed=0), decode=corrupting)
    checked(*batch(datas[:4], 0))
    assert checked.failure is None
    images = checked(*batch(datas[4:], 4))  # this batch comes back inverted: caught, decoded again on the CPU
    assert checked.failure is not None and "k0004" in checked.failure and "grey levels" in checked.failure
    reference = decode_images(datas[4:], ["jpg"] * 4, [1] * 4, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(images, reference))
    calls = corrupting.calls
    checked(*batch(datas[:2], 8))
    assert corrupting.calls == calls  # the device decoder is not asked again this run
    assert sum("wrong pixels" in r.getMessage() for r in caplog.records) == 1
    assert checked.record()["failure"] == checked.failure


def test_the_checked_images_are_a_fixed_share_chosen_by_key_and_seed():
    keys = [f"sample-{i}" for i in range(4096)]
    check = DecodeCheck(every=256, seed=3)
    picked = [k for k in keys if check.picks(k)]
    assert 4 <= len(picked) <= 40
    assert picked == [k for k in keys if DecodeCheck(every=256, seed=3).picks(k)]
    assert picked != [k for k in keys if DecodeCheck(every=256, seed=4).picks(k)]
    assert not any(DecodeCheck(every=0).picks(k) for k in keys)


def test_bad_settings_are_refused():
    with pytest.raises(InputError, match="every"):
        DecodeCheck(every=-1)
    with pytest.raises(InputError, match="tolerance"):
        DecodeCheck(tolerance=0)


@pytest.mark.slow
def test_precompute_with_a_corrupting_device_decoder_writes_the_cpus_features_and_says_so(tmp_path, monkeypatch):
    from preprocess.features.featurize import FeatureConfig, run_precompute
    from shards.formats.features import load_feature_shard
    from shards.image import checked_decode
    from tests.helpers import make_shard_dataset

    data_dir = tmp_path / "data"
    make_shard_dataset(data_dir, shard_sizes={"train": [6, 6]}, storage="tar", size=(48, 40))
    small = dict(backbone="resnet18", weights="none", resize=40, crop=32, batch_size=4, dtype="float32",
                 quiet=True, workers=0, decode="device", decode_check=1)
    healthy, healthy_stats = run_precompute(FeatureConfig(data_dir, tmp_path / "healthy", **small))
    assert healthy_stats["decode_check"]["failure"] is None and healthy_stats["decode_check"]["checked"] == 12
    monkeypatch.setattr(checked_decode, "device_decode", Corrupting(after=0))
    caught, stats = run_precompute(FeatureConfig(data_dir, tmp_path / "caught", **small))
    assert stats["decode_check"]["failure"] is not None and "grey levels" in stats["decode_check"]["failure"]
    for info_a, info_b in zip(healthy.splits["train"].shards, caught.splits["train"].shards):
        a = load_feature_shard(tmp_path / "healthy" / info_a.path)
        b = load_feature_shard(tmp_path / "caught" / info_b.path)
        assert torch.allclose(a.features, b.features, atol=1e-5)  # every row from the CPU's pixels
