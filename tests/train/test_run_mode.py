"""``train-from-shards --workers auto`` / ``--run-mode``: the loader's run mode in every ``metrics.jsonl`` row, the
trial and the choice of ``auto`` there and in the run report, and one model whatever the mode (one plan)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shards.runrecord import read_rows
from tests.train.test_cli import assert_one_line_error, run_cli

pytestmark = pytest.mark.slow

OPTIONS = ("--batch-size", "4", "--image-size", "32", "--decode", "fast", "--optimizer", "adamw",
           "--seed", "3")


def run(folder: Path, out: Path, *options: str, epochs: int = 2) -> tuple[dict, list[dict]]:
    result = run_cli(folder, "--out", out, "--epochs", str(epochs), *OPTIONS, *options)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), [row.to_json() for row in read_rows(out / "metrics.jsonl")]


def test_auto_records_its_trial_and_choice_and_trains_the_model_of_its_plan(image_folder: Path, tmp_path: Path):
    # Batches of 2: 24 an epoch; on 2 CPUs 4 candidates of about 17 batches each, and a runoff of two of them when
    # they are close (about 34 more): the trial ends by epoch 5
    summary, rows = run(image_folder, tmp_path / "auto", "--workers", "auto", "--batch-size", "2", epochs=6)
    last = rows[-1]["run_mode"]
    assert last["mode"].startswith("Auto(workers=")
    trial = {entry["mode"]: entry for entry in last["trial"]}
    assert any(mode.startswith("Threads(") for mode in trial) and any(m.startswith("WorkerProcesses(") for m in trial)
    assert last["chosen"] in trial and all(entry["batches"] > 0 for entry in trial.values())
    finalists = last["runoff"] or list(trial)
    assert trial[last["chosen"]]["step_s"] == min(trial[mode]["step_s"] for mode in finalists)
    report = (tmp_path / "auto" / "report.html").read_text()
    assert "Run mode (auto)" in report and last["chosen"] in report
    # Auto feeds the batches of its plan: the same model as the default mode of the same worker count.
    workers = int(last["mode"].split("workers=")[1].split(",")[0])
    fixed, fixed_rows = run(image_folder, tmp_path / "fixed", "--workers", str(workers), "--batch-size", "2",
                            epochs=6)
    assert fixed_rows[-1]["run_mode"] == {"mode": f"WorkerProcesses(workers={workers}, prefetch=4, "
                                                  "persistent=True, decoders=0)"}
    assert [r["train_loss"] for r in fixed_rows] == [r["train_loss"] for r in rows]
    assert fixed["val_top1"] == summary["val_top1"]


def test_threads_train_the_model_processes_train(image_folder: Path, tmp_path: Path):
    _, threads = run(image_folder, tmp_path / "threads", "--workers", "2", "--run-mode", "threads")
    _, processes = run(image_folder, tmp_path / "processes", "--workers", "2", "--worker-threads", "2")
    assert threads[-1]["run_mode"]["mode"].startswith("Threads(workers=2")
    assert processes[-1]["run_mode"]["mode"].endswith("decoders=2)")
    assert [r["train_loss"] for r in threads] == [r["train_loss"] for r in processes]


def test_a_bad_worker_count_or_mode_is_one_line(image_folder: Path, tmp_path: Path):
    result = run_cli(image_folder, "--out", tmp_path / "bad", "--workers", "many")
    assert result.exit_code == 2 and "neither a worker count nor 'auto'" in result.output
    assert_one_line_error(run_cli(image_folder, "--out", tmp_path / "bad2", "--workers", "0", "--run-mode",
                                  "threads"), "loader.run_mode='threads' needs workers >= 1")
