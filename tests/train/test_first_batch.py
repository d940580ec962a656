"""Time to first batch: every start and every resume of a run records, on the metrics row of the epoch it happened
in, how long its first batch took and where the time went (open, plan, first read, other), and says it once above
the progress bar. No assertion is about speed: only that the numbers exist, are non-negative and add up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.train.test_train_features import config
from train.run.checkpoint import load_checkpoint
from train.run.first_batch import PARTS, describe, first_batch_record
from train.run.loop import train
from shards.runrecord import read_rows

TOLERANCE_S = 1e-6


def assert_adds_up(record: dict) -> None:
    assert all(record[name] >= 0 for name in (*PARTS, "first_batch_s"))
    assert record["open_s"] + record["plan_s"] + record["first_read_s"] <= record["first_batch_s"] + TOLERANCE_S
    assert sum(record[name] for name in PARTS) == pytest.approx(record["first_batch_s"], abs=TOLERANCE_S)


def test_a_run_records_its_start_on_the_first_epoch_row_only(feature_folder: Path, tmp_path: Path):
    train(config(feature_folder, tmp_path / "run", epochs=2))
    first, second = [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")]
    [record] = first["first_batch"]
    assert record["resume"] is False and record["epoch"] == 1 and record["step"] == 0
    assert record["open_s"] > 0  # open_dataset was timed, not left at its default
    assert_adds_up(record)
    assert "first_batch" not in second


def test_a_resume_records_its_own_first_batch(feature_folder: Path, tmp_path: Path):
    run = tmp_path / "run"
    options = dict(epochs=2, checkpoint_every=3)
    assert train(config(feature_folder, run, stop_after_steps=4, **options))["stopped"]
    # The start's record survives the kill in the mid-epoch checkpoint (step 3), as the epoch's sums do.
    [kept] = load_checkpoint(run / "last.pt")["train_state"]["first_batch"]
    assert kept["resume"] is False
    train(config(feature_folder, run, resume=True, **options))
    first, second = [row.to_json() for row in read_rows(run / "metrics.jsonl")]
    start, resume = first["first_batch"]
    assert (start["resume"], resume["resume"]) == (False, True)
    assert (resume["epoch"], resume["step"]) == (1, 3)  # continued after the 3 steps the checkpoint held
    for record in (start, resume):
        assert_adds_up(record)
    assert "first_batch" not in second


@pytest.mark.slow
def test_image_workers_split_the_wait_into_plan_and_first_read(image_folder: Path, tmp_path: Path):
    train(config(image_folder, tmp_path / "run", epochs=1, batch_size=8, workers=2, image_size=32, name="resnet18"))
    [record] = [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")][0]["first_batch"]
    assert record["workers"] == 2
    assert record["first_read_s"] > 0  # the workers' read and decode seconds reached the main process
    assert_adds_up(record)


def test_the_record_adds_up_even_when_worker_seconds_exceed_the_wait():
    # Eight workers busy side by side can report more seconds than the loop waited: first read is capped.
    record = first_batch_record(started=10.0, arrived=13.0, open_s=0.5, wait_s=1.0,
                                worker_seconds={"read": 9.0, "decode": 7.0}, workers=8, resume=False, epoch=1,
                                step=0)
    assert (record["plan_s"], record["first_read_s"]) == (0.0, 1.0)
    assert record["other_s"] == pytest.approx(1.5)
    assert_adds_up(record)
    assert describe(record) == ("first batch 3.00 s after start (open 0.50, plan 0.00, first read 1.00, "
                                "other 1.50)")


@pytest.mark.slow
def test_the_progress_line_says_it_once(feature_folder: Path, tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "train", str(feature_folder), "--out", str(tmp_path / "run"), "--epochs", "2",
         "--batch-size", "16", "--device", "cpu", "--no-report"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "first batch" in line]
    assert len(lines) == 1 and "after start (open " in lines[0]
    [record] = [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")][0]["first_batch"]
    assert f"first batch {record['first_batch_s']:.2f} s" in lines[0]
