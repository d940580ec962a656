"""shards inspect: the summary, one batch through the eval transform, and the augmentation grid."""

import json

import numpy as np
from click.testing import CliRunner
from PIL import Image

from shards.cli.main import main
from shards.check.inspect import batch_report, label_band_px, labelled_grid, save_grid, summarize
from tests.helpers import make_shard_dataset


def test_summary_lists_classes_shards_and_sizes(tmp_path):
    manifest = make_shard_dataset(tmp_path)
    summary = summarize(tmp_path)
    assert [c["name"] for c in summary["classes"]] == ["a", "b", "c"]
    assert summary["classes"][0]["counts"] == {"train": 8, "val": 4}
    assert summary["splits"]["train"]["shards"] == 4 and summary["splits"]["train"]["samples"] == 24
    assert summary["splits"]["train"]["samples_per_shard"] == {"min": 3, "max": 9}
    assert summary["bytes"] == sum(s.bytes for split in manifest.splits.values() for s in split.shards)


def test_batch_report_shows_shape_dtype_range_and_labels(tmp_path):
    make_shard_dataset(tmp_path)
    report = batch_report(tmp_path, batch_size=6, image_size=32)
    assert report["split"] == "val"
    assert report["shape"] == [6, 3, 32, 32] and report["dtype"] == "float32"
    assert -2.2 < report["min"] < report["max"] < 2.7  # ImageNet-normalised, not 0..255
    assert report["label_counts"] == {"a": 2, "b": 2, "c": 2}


def test_grid_is_saved_as_a_png_with_a_label_band_under_each_image(tmp_path):
    make_shard_dataset(tmp_path / "ds")
    result = save_grid(tmp_path / "ds", tmp_path / "grid.png", count=4, image_size=24)
    assert result["images"] == 4 and len(result["labels"]) == 4
    assert set(result["labels"]) <= {"a", "b", "c"}
    band = label_band_px(24)
    with Image.open(tmp_path / "grid.png") as grid:
        assert grid.format == "PNG" and grid.size == (4 * 24 + 5 * 2, 24 + band + 2 * 2)
        for column in range(4):
            left = 2 + column * (24 + 2)
            label = grid.convert("L").crop((left, 2 + 24, left + 24, 2 + 24 + band))
            low, high = label.getextrema()
            assert high == 255 and low < 128  # a white band with dark text on it, not a blank strip


def test_long_class_names_are_cut_to_the_image_width():
    images = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    grid = labelled_grid(images, ["x" * 80, "y"], columns=2)
    band = label_band_px(32)
    assert grid.size == (2 * 32 + 3 * 2, 32 + band + 2 * 2)
    gap = grid.convert("L").crop((2 + 32, 2 + 32, 2 + 32 + 2, 2 + 32 + band))
    assert gap.getextrema() == (0, 0)  # the padding between the two labels is untouched


def test_cli_prints_a_table_on_stderr_and_json_on_stdout(tmp_path):
    make_shard_dataset(tmp_path / "ds")
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "ds"), "--batch", "--batch-size", "4",
                                       "--image-size", "32", "--grid", str(tmp_path / "g.png"), "--grid-count", "2"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["batch"]["shape"] == [4, 3, 32, 32] and data["grid"]["images"] == 2
    assert "train: 24 samples in 4 shards" in result.stderr and "batch (val)" in result.stderr
    assert (tmp_path / "g.png").is_file()


def test_unknown_split_exits_2(tmp_path):
    make_shard_dataset(tmp_path)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path), "--batch", "--split", "test"])
    assert result.exit_code == 2 and "no split 'test'" in result.stderr
