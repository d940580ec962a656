"""Lineage of a train-from-shards run: ``shards lineage`` computes, from config.json and data-events.jsonl alone,
exactly the keys ``--record-keys`` saw each step take, across a SIGKILL and a resume on another worker count that
also adds an exclusion list; the excluded keys leave the rest of the epoch and the next one, nothing else does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from shards.cli.main import main as shards_main
from tests.train.configs import train_config
from shards.data_events import read_events
from shards.check.lineage import run_lineage
from train.run.lineage import read_recorded_keys
from train.run.loop import train

TIMEOUT_S = 240
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ALL_KEYS = {f"train_{i:05d}" for i in range(48)}  # colour_shards: train 20/14/14


def command(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", str(data), "--out", str(out), "--epochs", "2", "--batch-size", "4",
            "--image-size", "32", "--optimizer", "adamw", "--device", "cpu", "--checkpoint-every", "2", "--quiet",
            "--record-keys", *extra]


def killed_after(cmd: list[str], keys_file: Path, step: int) -> None:
    """Run ``cmd`` and SIGKILL it as soon as it has been handed the batch of ``step``."""
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if keys_file.exists() and any(json.loads(line)["step"] >= step
                                      for line in keys_file.read_text().splitlines() if line.endswith("}")):
            break
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


@pytest.mark.slow
def test_lineage_equals_recorded_keys_across_a_sigkill_and_a_resume_on_three_workers(image_folder: Path,
                                                                                     tmp_path: Path):
    run = tmp_path / "run"
    killed_after(command(image_folder, run, "--workers", "2"), run / "keys.jsonl", 7)
    excluded = ["train_00001", "train_00017", "train_00025", "train_00040", "train_00047", "absent"]
    (tmp_path / "exclude.txt").write_text("\n".join(excluded) + "\n")
    resumed = subprocess.run(command(image_folder, run, "--workers", "3", "--resume", "--exclude-keys",
                                     str(tmp_path / "exclude.txt")),
                             capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    events = read_events(run)
    layouts = [e for e in events if e["kind"] == "layout"]
    assert [e["num_workers"] for e in layouts] == [2, 3]
    resumed_at = layouts[1]
    assert resumed_at["loader_state"] is not None and resumed_at["step"] >= 6  # mid-epoch: a checkpoint's step
    exclude = [e for e in events if e["kind"] == "exclude"]
    assert len(exclude) == 1 and exclude[0]["count"] == 6 and exclude[0]["step"] == resumed_at["step"]

    recorded = read_recorded_keys(run)  # a step fed again after the resume: its last line
    steps = sorted(step for _, step, _ in recorded)
    assert steps == list(range(1, len(steps) + 1))
    for (epoch, step, rank), fed in sorted(recorded.items(), key=lambda item: item[0][1]):
        assert run_lineage(run, epoch, step, rank)["keys"] == fed, (epoch, step)

    gone = set(excluded[:-1])
    before = {k for (e, s, _), fed in recorded.items() if s <= resumed_at["step"] for k in fed}
    epoch1 = [k for (e, _, _), fed in recorded.items() if e == 1 for k in fed]
    epoch2 = [k for (e, _, _), fed in recorded.items() if e == 2 for k in fed]
    # The train loader drops the last partial batch (fewer than 4 samples), nothing else.
    for fed, expected in ((epoch1, ALL_KEYS - (gone - before)), (epoch2, ALL_KEYS - gone)):
        assert len(fed) == len(set(fed)) and set(fed) <= expected and len(expected) - len(fed) < 4

    cli = CliRunner().invoke(shards_main, ["lineage", str(run), "--epoch", "2", "--step", str(steps[-1])])
    assert cli.exit_code == 0, cli.output
    answer = json.loads(cli.stdout.strip().splitlines()[-1])
    assert answer["ranks"]["0"]["keys"] == recorded[(2, steps[-1], 0)]
    assert all(s["shard"].endswith(".tar") for s in answer["ranks"]["0"]["samples"])


def test_feature_run_lineage_matches_recorded_keys_and_refuses_a_step_of_another_epoch(feature_folder: Path,
                                                                                     tmp_path: Path):
    run = tmp_path / "run"
    train(train_config(str(feature_folder), str(run), epochs=2, batch_size=64,
                      workers=0, quiet=True, device="cpu", record_keys=True, stop_after_steps=3))
    assert [e["kind"] for e in read_events(run)] == ["layout"]
    recorded = read_recorded_keys(run)  # 161 samples, batches of 64, drop_last: 2 steps per epoch
    assert sorted(recorded) == [(1, 1, 0), (1, 2, 0), (2, 3, 0)]
    for (epoch, step, rank), fed in recorded.items():
        assert run_lineage(run, epoch, step)["ranks"]["0"]["keys"] == fed
    result = CliRunner().invoke(shards_main, ["lineage", str(run), "--epoch", "1", "--step", "3"])
    assert result.exit_code == 2 and "epoch 2" in result.output
    result = CliRunner().invoke(shards_main, ["lineage", str(run), "--epoch", "1", "--step", "1", "--rank", "1"])
    assert result.exit_code == 2 and "rank" in result.output
    (run / "data-events.jsonl").unlink()
    result = CliRunner().invoke(shards_main, ["lineage", str(run), "--epoch", "1", "--step", "1"])
    assert result.exit_code == 2 and "no layout event" in result.output


@pytest.mark.slow
def test_two_rank_torchrun_lineage_equals_each_ranks_recorded_keys(feature_folder: Path, tmp_path: Path):
    run = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train",
               str(feature_folder), "--out", str(run), "--epochs", "2", "--batch-size", "8", "--device", "cpu",
               "--quiet", "--record-keys"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    recorded = read_recorded_keys(run)
    assert {rank for _, _, rank in recorded} == {0, 1}
    for epoch, step in sorted({(e, s) for e, s, _ in recorded}):
        answer = run_lineage(run, epoch, step)
        assert {int(r): a["keys"] for r, a in answer["ranks"].items()} == \
            {0: recorded[(epoch, step, 0)], 1: recorded[(epoch, step, 1)]}


def test_a_mixture_runs_exclusion_cannot_change_at_resume_a_single_datasets_can(tmp_path: Path):
    from shards.errors import OutputExistsError
    from train.run.run_dir import RunPlan, plan_run, start_run

    keys = tmp_path / "keys.txt"
    keys.write_text("a\n")
    for subset, refused in (({"classes": ["red"]}, True), (None, False)):
        run = tmp_path / f"run-{refused}"
        old = train_config(str(tmp_path), str(run), subset=subset)
        start_run(RunPlan(run, None), old)
        resumed = old.replace({"run.resume": True, "data.exclude_keys": str(keys)})
        if refused:
            with pytest.raises(OutputExistsError, match="exclude-keys"):
                plan_run(resumed)
        else:
            assert plan_run(resumed).folder == run
