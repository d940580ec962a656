"""``train-from-shards`` records its storage forecast in metrics.jsonl, made from its own run record as it starts,
beside what each epoch's train reads measured."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from shards.runrecord import read_rows
from train.cli import train_command

COUNTERS = ("hits", "misses", "bypasses", "evictions")


@pytest.mark.slow
def test_each_epoch_holds_its_forecast_beside_the_measured_counters(image_folder: Path, tmp_path: Path):
    result = CliRunner().invoke(train_command, [
        str(image_folder), "--out", str(tmp_path / "run"), "--model", "resnet18", "--image-size", "32",
        "--epochs", "3", "--batch-size", "8", "--workers", "1", "--device", "cpu", "--quiet",
        "--cache-dir", str(tmp_path / "node"), "--cache-local"])
    assert result.exit_code == 0, result.output
    rows = [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")]
    assert all("forecast" in row and "storage" in row for row in rows)
    for row in rows:  # one reader (one worker) through the cache: the forecast's counters are the cache's
        assert {k: row["forecast"][k] for k in COUNTERS} == {k: row["storage"][k] for k in COUNTERS}
        assert row["forecast"]["requests"] == row["storage"]["requests"] == 0  # local files: no object storage
    assert rows[0]["forecast"]["misses"] == 3 and rows[1]["forecast"]["hits"] == rows[1]["storage"]["hits"] > 0
