"""Two-process DDP (torchrun, gloo, CPU) over uneven shards: finishes, matches one process, resumes exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.report.page import parse
from tests.train.configs import train_config
from train.run.loop import train
from shards.runrecord import read_rows

TIMEOUT_S = 240  # a hang fails the test instead of blocking the suite


def torchrun(feature_folder: Path, out: Path, *extra: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train",
               str(feature_folder), "--out", str(out), "--epochs", "3", "--batch-size", "8", "--device", "cpu",
               "--checkpoint-every", "4", "--quiet", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1  # rank 0 alone reports
    return summaries[0]


@pytest.mark.slow
def test_two_rank_gloo_run_matches_single_process_and_resumes_exactly(feature_folder: Path, tmp_path: Path):
    # 161 train samples in shards of 70/45/29/17 and 61 val samples: neither divides by 2 ranks.
    ddp = torchrun(feature_folder, tmp_path / "ddp")
    assert ddp["world_size"] == 2

    # The same global batch (2 x 8) in one process.
    single = train(train_config(str(feature_folder), str(tmp_path / "single"), epochs=3,
                               batch_size=16, device="cpu", quiet=True))
    assert ddp["steps"] == single["steps"] == 30
    assert ddp["val_top1"] >= 0.9
    assert abs(ddp["val_top1"] - single["val_top1"]) <= 0.05
    assert abs(ddp["val_loss"] - single["val_loss"]) <= 0.1
    assert abs(ddp["train_loss"] - single["train_loss"]) <= 0.1
    rows = [row.to_json() for row in read_rows(tmp_path / "ddp" / "metrics.jsonl")]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert rows[-1]["val_samples"] == 62  # both ranks' shares summed: 61 val samples padded to 2 x 31
    assert len(rows[-1]["stage_seconds_by_rank"]) == 2
    page = (tmp_path / "ddp" / "report.html").read_text(encoding="utf-8")  # written by rank 0 as epochs end
    assert "per rank (2 ranks)" in page
    assert [row[0] for row in parse(page).table("rank")] == ["0", "1"]  # a real torchrun run's two ranks

    # Killed in epoch 2 (after its checkpoint at step 12), then resumed: every rank continues from rank 0's state.
    assert torchrun(feature_folder, tmp_path / "resumed", "--stop-after-steps", "14")["stopped"]
    torchrun(feature_folder, tmp_path / "resumed", "--resume")
    expected = torch.load(tmp_path / "ddp" / "model.pt", weights_only=True)["state_dict"]
    actual = torch.load(tmp_path / "resumed" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
