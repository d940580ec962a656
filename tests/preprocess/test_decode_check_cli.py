"""``precompute-features --decode-check N|off``: how often ``--decode device`` proves its pixels against the CPU
(``shards.image.checked_decode``); the count lands in ``FeatureConfig.decode_check`` and the summary's record."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from preprocess.features.cli import precompute_features_command
from tests.helpers import make_shard_dataset


def run(data_dir, out, *extra: str):
    return CliRunner().invoke(precompute_features_command, [
        str(data_dir), "--out", str(out), "--weights", "none", "--backbone", "resnet18", "--resize", "40", "--crop",
        "32", "--batch-size", "4", "--workers", "0", "--dtype", "float32", "--decode", "device", "--quiet", *extra])


@pytest.mark.slow
def test_the_command_line_sets_how_often_device_decoding_is_checked(tmp_path):
    data_dir = tmp_path / "data"
    make_shard_dataset(data_dir, shard_sizes={"train": [6, 6]}, storage="tar", size=(48, 40))
    every_image = run(data_dir, tmp_path / "every", "--decode-check", "1")
    assert every_image.exit_code == 0, every_image.output
    record = json.loads(every_image.output.strip().splitlines()[-1])["decode_check"]
    assert record["every"] == 1 and record["checked"] == 12 and record["failure"] is None
    off = run(data_dir, tmp_path / "off", "--decode-check", "off")
    assert off.exit_code == 0, off.output
    record = json.loads(off.output.strip().splitlines()[-1])["decode_check"]
    assert record["every"] == 0 and record["checked"] == 0


@pytest.mark.parametrize("value", ["-1", "1/256", "some"])
def test_a_bad_count_is_a_usage_error_naming_the_option(tmp_path, value):
    result = run(tmp_path / "data", tmp_path / "out", "--decode-check", value)
    assert result.exit_code == 2
    assert "--decode-check" in result.output and "off" in result.output


def test_the_help_documents_the_option_and_its_default():
    result = CliRunner().invoke(precompute_features_command, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "--decode-check N|off" in text and "1 in N images" in text and "default: 256" in text
