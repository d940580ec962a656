"""The resume audit in train-from-shards: a run killed mid-epoch (SIGKILL, or ``--stop-after-steps``, which stops
as a kill would) and resumed on 1, 2 or 3 workers, or on 1, 2 or 3 ranks, audits every resume with 0 mismatches,
records it in data-events.jsonl, the run report says so and ``shards audit RUN_DIR`` agrees; a checkpoint whose
record disagrees with the plan is refused at ``--resume`` (``--resume-audit refuse``, the default), named in one
line, or let through with a warning (``warn``) that the report and ``shards audit`` then show."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shards.cli.main import main as shards_main
from shards.data_events import LAYOUT, RESUME_AUDIT, read_events, resume_audits
from shards.position.audit import ResumeAuditError
from tests.train.configs import train_config
from tests.train.test_lineage import ENV, TIMEOUT_S, command, killed_after
from train.run.loop import train


def audited(run: Path) -> dict:
    result = CliRunner().invoke(shards_main, ["audit", str(run)])
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.exit_code == (1 if answer["mismatches"] else 0), result.output
    return answer


def report_text(run: Path) -> str:
    result = CliRunner().invoke(shards_main, ["report", str(run), "--no-grid", "--quiet"])
    assert result.exit_code == 0, result.output
    return (run / "report.html").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(1, 2), (2, 3), (3, 1)])
def test_killed_and_resumed_on_other_worker_counts_audits_every_resume_with_no_mismatch(image_folder: Path,
                                                                                       tmp_path: Path, before: int,
                                                                                       after: int):
    run = tmp_path / "run"
    killed_after(command(image_folder, run, "--workers", str(before)), run / "keys.jsonl", 7)
    resumed = subprocess.run(command(image_folder, run, "--workers", str(after), "--resume"), capture_output=True,
                             text=True, timeout=TIMEOUT_S, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    layout = read_events(run, LAYOUT)[-1]
    assert layout["loader_state"] is not None and layout["resume_audit"] == {"result": "ok", "batches": 4}
    assert [e["result"] for e in read_events(run, RESUME_AUDIT)] == ["ok"]  # the first batches fed after it
    answer = audited(run)
    assert (answer["resumes"], answer["audited"], answer["mismatches"]) == (1, 1, 0)
    assert "1 resumes audited, 0 mismatches" in report_text(run)


def torchrun(feature_folder: Path, out: Path, ranks: int, *extra: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "train",
           str(feature_folder), "--out", str(out), "--epochs", "2", "--batch-size", "8", "--device", "cpu",
           "--checkpoint-every", "3", "--quiet", *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_stopped_and_resumed_on_one_two_and_three_ranks_audits_every_resume_with_no_mismatch(feature_folder: Path,
                                                                                            tmp_path: Path):
    run = tmp_path / "run"
    train(train_config(str(feature_folder), str(run), epochs=2, batch_size=8, checkpoint_every=3, quiet=True,
                       device="cpu", stop_after_steps=5))
    torchrun(feature_folder, run, 2, "--resume", "--stop-after-steps", "10")
    torchrun(feature_folder, run, 3, "--resume")
    layouts = read_events(run, LAYOUT)
    assert [e["world_size"] for e in layouts] == [1, 2, 3]
    assert [e["resume_audit"]["result"] for e in layouts[1:]] == ["ok", "ok"]
    assert resume_audits(run)["mismatches"] == 0
    answer = audited(run)
    assert (answer["resumes"], answer["audited"], answer["mismatches"]) == (2, 2, 0)


def stopped_feature_run(feature_folder: Path, run: Path) -> Path:
    train(train_config(str(feature_folder), str(run), epochs=2, batch_size=16, checkpoint_every=2, quiet=True,
                       device="cpu", stop_after_steps=5))
    return run / "last.pt"


def off_by_one(last: Path) -> None:
    """The checkpoint's loader position one batch back, as a slip in the position arithmetic would save it."""
    checkpoint = torch.load(last, weights_only=True)
    checkpoint["loader"]["batches"] -= 1
    torch.save(checkpoint, last)


@pytest.mark.slow
def test_a_resume_whose_position_is_off_by_one_is_refused_or_warned_and_shown(feature_folder: Path,
                                                                             tmp_path: Path):
    run = tmp_path / "run"
    off_by_one(stopped_feature_run(feature_folder, run))
    with pytest.raises(ResumeAuditError, match=r"^resume audit: epoch 1, batch 4 of the epoch .*handed out 4$"):
        train(train_config(str(feature_folder), str(run), epochs=2, batch_size=16, checkpoint_every=2, quiet=True,
                           device="cpu", resume=True))
    train(train_config(str(feature_folder), str(run), epochs=2, batch_size=16, checkpoint_every=2, quiet=True,
                       device="cpu", resume=True, resume_audit="warn"))
    assert read_events(run, LAYOUT)[-1]["resume_audit"]["result"] == "mismatch"
    answer = audited(run)
    assert answer["mismatches"] == 1 and "batch 4 of the epoch" in answer["results"][0]["message"]
    assert "1 resumes audited, 1 mismatches" in report_text(run)


@pytest.mark.slow
def test_the_cli_refuses_by_default_in_one_line(feature_folder: Path, tmp_path: Path):
    run = tmp_path / "run"
    off_by_one(stopped_feature_run(feature_folder, run))
    result = subprocess.run([sys.executable, "-m", "train", str(feature_folder), "--out", str(run), "--epochs", "2",
                             "--batch-size", "16", "--checkpoint-every", "2", "--device", "cpu", "--resume"],
                            capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if "resume audit" in line]
    assert len(lines) == 1 and "epoch 1, batch 4 of the epoch" in lines[0]
