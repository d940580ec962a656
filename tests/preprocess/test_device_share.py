"""``--decode device --device-share F``: CPU workers and the model's device share the decoding, each image going to
the one its key picks, so the features are those of one path or the other, row for row, and the same on every run.
Run on the CPU with the same code path as on a GPU."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from preprocess.features.cli import precompute_features_command
from preprocess.features.featurize import FeatureConfig, precompute_features
from preprocess.features.loader import decodes_on_device
from shards.errors import InputError
from shards.formats.features import load_feature_shard
from tests.helpers import make_shard_dataset

SMALL = dict(backbone="resnet18", weights="none", resize=40, crop=32, batch_size=4, dtype="float32", quiet=True)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("share")
    # Five times the resize: the fast path decodes these at 1/4 scale (DCT scaling), the device path at full size,
    # so the two paths' features differ and each row can be told to have come from its own.
    make_shard_dataset(root, shard_sizes={"train": [7, 6, 5]}, storage="tar", size=(200, 160))
    return root


def _features(folder, manifest) -> dict[str, torch.Tensor]:
    out = {}
    for info in manifest.splits["train"].shards:
        shard = load_feature_shard(folder / info.path)
        out.update(zip(shard.keys, shard.features))
    return out


def test_the_share_picks_images_by_key_alone():
    keys = [f"sample-{i:05d}" for i in range(4000)]
    half = [decodes_on_device(k, 0.5) for k in keys]
    assert abs(sum(half) / len(keys) - 0.5) < 0.03
    assert half == [decodes_on_device(k, 0.5) for k in keys]
    assert all(decodes_on_device(k, 1.0) for k in keys) and not any(decodes_on_device(k, 0.0) for k in keys)
    # a larger share keeps every image a smaller one sent to the device
    assert all(decodes_on_device(k, 0.7) for k, on in zip(keys, half) if on)


@pytest.mark.slow
def test_shared_decoding_gives_each_rows_own_paths_features(data_dir, tmp_path):
    device_only = precompute_features(FeatureConfig(data_dir, tmp_path / "device", decode="device", workers=0, **SMALL))
    workers_only = precompute_features(FeatureConfig(data_dir, tmp_path / "fast", decode="fast", workers=0, **SMALL))
    shared = precompute_features(FeatureConfig(data_dir, tmp_path / "shared", decode="device", device_share=0.5,
                                               workers=2, **SMALL))
    again = precompute_features(FeatureConfig(data_dir, tmp_path / "again", decode="device", device_share=0.5,
                                              workers=0, batch_size=3, **{k: v for k, v in SMALL.items()
                                                                           if k != "batch_size"}))
    assert shared.config["decode"] == "decode_jpeg:cpu@0.5+fast" and device_only.config["decode"] == "decode_jpeg:cpu"
    assert shared.config_hash not in (device_only.config_hash, workers_only.config_hash)
    assert again.config_hash == shared.config_hash
    by_device, by_workers = _features(tmp_path / "device", device_only), _features(tmp_path / "fast", workers_only)
    features, features_again = _features(tmp_path / "shared", shared), _features(tmp_path / "again", again)
    picked = {key: decodes_on_device(key, 0.5) for key in features}
    assert 0 < sum(picked.values()) < len(picked)  # both paths fed this run
    differ = 0
    for key, row in features.items():
        own, other = (by_device, by_workers) if picked[key] else (by_workers, by_device)
        assert torch.allclose(row, own[key], atol=1e-4, rtol=1e-4), key
        assert torch.allclose(row, features_again[key], atol=1e-4, rtol=1e-4), key
        differ += not torch.allclose(row, other[key], atol=1e-4, rtol=1e-4)
    assert differ > 0  # the two paths' features are told apart, so the rows above were checked against the right one


@pytest.mark.parametrize("changes, message", [
    (dict(decode="fast", device_share=0.5), "it needs decode 'device' \\(not 'fast'\\)"),
    (dict(decode="device", device_share=0.5, views=1, augment=True), "and no --augment"),
    (dict(decode="device", device_share=1.5), "must be between 0 and 1"),
])
def test_a_share_that_cannot_apply_is_refused(data_dir, tmp_path, changes, message):
    with pytest.raises(InputError, match=message):
        FeatureConfig(data_dir, tmp_path / "out", **{**SMALL, **changes})


@pytest.mark.slow  # over half a second in the quick loop
def test_the_command_line_takes_the_share(data_dir, tmp_path):
    result = CliRunner().invoke(precompute_features_command, [
        str(data_dir), "--out", str(tmp_path / "cli"), "--weights", "none", "--backbone", "resnet18", "--resize",
        "40", "--crop", "32", "--batch-size", "4", "--workers", "0", "--decode", "device", "--device-share", "0.25",
        "--quiet"])
    assert result.exit_code == 0, result.output
    assert '"decode": "decode_jpeg:cpu@0.25+fast"' in result.output
    result = CliRunner().invoke(precompute_features_command, [
        str(data_dir), "--out", str(tmp_path / "bad"), "--weights", "none", "--device-share", "2"])
    assert result.exit_code == 2
