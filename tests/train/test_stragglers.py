"""Straggler ranks named: the slowest rank and its cause (data or compute), the warning after two epochs of one
rank waiting for data, the report's table, and a real 2-rank torchrun run whose rank 1 decodes slowly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shards.report.build import build_report
from shards.runrecord import EpochRow, read_rows, write_rows
from tests.report.page import parse
from train.run.diagnose import (WARN_EXCESS_S, Straggler, run_straggler_warning, slowest_rank, straggler_fields,
                                sustained_straggler)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240


def ranks(*wait_step: tuple[float, float]) -> list[dict[str, float]]:
    return [{"read": 1.0, "decode": 2.0, "wait": wait, "to_device": 0.01, "step": step} for wait, step in wait_step]


def data_straggler(rank: int, wait_s: float, others_wait_s: float) -> Straggler:
    return Straggler(rank, "data", wait_s, others_wait_s, 1.0, 4.0)


def test_one_process_has_no_slowest_rank_and_no_fields():
    assert slowest_rank(ranks((3.0, 1.0))) is None
    assert slowest_rank([]) is None
    assert straggler_fields(ranks((3.0, 1.0))) == {}


def test_the_rank_whose_wait_stands_out_is_the_data_straggler():
    # As DDP shows it: rank 1 waits for its loader, ranks 0 and 2 wait for rank 1 inside their step.
    straggler = slowest_rank(ranks((0.2, 5.0), (4.0, 1.2), (0.3, 5.1)))
    assert (straggler.rank, straggler.cause) == (1, "data")
    assert straggler.others_wait_s == pytest.approx(0.25)
    assert straggler.wait_ratio == pytest.approx(16.0)
    assert straggler.others_step_s == pytest.approx(5.05)
    fields = straggler_fields(ranks((0.2, 5.0), (4.0, 1.2), (0.3, 5.1)))
    assert fields["slowest_rank"] == 1 and fields["slowest_rank_cause"] == "data"
    assert fields["rank_wait_s"] == [0.2, 4.0, 0.3] and fields["rank_step_s"] == [5.0, 1.2, 5.1]
    assert json.loads(json.dumps(fields)) == fields  # plain JSON, no Infinity


def test_without_a_wait_that_stands_out_the_epoch_is_compute_bound():
    straggler = slowest_rank(ranks((0.01, 3.0), (0.03, 3.2)))  # 20 ms more wait: under 10% of the loop
    assert (straggler.rank, straggler.cause) == (1, "compute")
    assert "compute" in straggler.describe() and "rank 1" in straggler.describe()
    assert slowest_rank(ranks((0.5, 3.0), (0.5, 3.0))).rank == 0  # a tie names the lowest rank, every time


def test_a_rank_that_waits_while_the_others_never_do():
    straggler = slowest_rank(ranks((0.0, 4.0), (3.0, 1.0)))
    assert (straggler.rank, straggler.cause, straggler.wait_ratio) == (1, "data", None)
    assert straggler.waits_over(2.0) and "the others did not wait" in straggler.describe()
    assert straggler_fields(ranks((0.0, 4.0), (3.0, 1.0)))["slowest_rank_wait_ratio"] is None


def test_the_warning_needs_the_same_rank_over_2x_for_two_consecutive_epochs():
    slow = data_straggler(1, 3.0, 0.5)
    assert sustained_straggler([slow, slow]) == slow
    assert sustained_straggler([None, slow, None, slow, slow]) == slow  # the last two epochs decide
    assert sustained_straggler([slow]) is None  # one epoch is not yet a pattern
    assert sustained_straggler([slow, None]) is None
    assert sustained_straggler([data_straggler(0, 3.0, 0.5), slow]) is None  # another rank each epoch
    assert sustained_straggler([slow, data_straggler(1, 1.9, 1.0)]) is None  # 1.9x the others: under 2x
    assert sustained_straggler([slow, Straggler(1, "compute", 3.0, 0.5, 4.0, 4.0)]) is None
    tiny = data_straggler(1, 0.3, 0.01)  # 30x, but the others lose 0.29 s to it
    assert tiny.excess_wait_s < WARN_EXCESS_S and sustained_straggler([tiny, tiny]) is None
    never = data_straggler(1, 2.0, 0.0)
    assert sustained_straggler([never, never]) == never


def test_the_warning_from_the_rows_recorded_so_far():
    """A resumed run's history is its rows: the warning reads the stragglers they recorded."""
    rows = [{"epoch": 1, **straggler_fields(ranks((0.1, 4.0), (3.0, 1.0)))},
            {"epoch": 2, **straggler_fields(ranks((0.2, 4.0), (3.5, 1.0)))}]
    assert "rank 1 has waited for data more than 2x" in run_straggler_warning(rows)
    assert run_straggler_warning(rows[:1]) is None
    assert run_straggler_warning([{"epoch": 1}, *rows[:1]]) is None  # an epoch of one process: no straggler


def write_run(folder: Path, per_epoch: list[list[dict[str, float]]]) -> Path:
    """Epoch rows as the loop records them: each epoch's straggler fields, and the warning once it is due."""
    folder.mkdir()
    rows: list[dict] = []
    for i, by_rank in enumerate(per_epoch):
        row = {"epoch": i + 1, "train_loss": 1.0, "val_loss": 1.0, "val_top1": 0.5, "data_wait_share": 0.1,
               "epoch_time_s": 5.0, "stage_seconds_by_rank": by_rank, **straggler_fields(by_rank)}
        rows.append({**row, "straggler_warning": run_straggler_warning([*rows, row])})
    write_rows(folder / "metrics.jsonl", [EpochRow(**row) for row in rows])
    return folder


def test_the_report_names_each_epochs_slowest_rank_and_warns(tmp_path: Path):
    run = write_run(tmp_path / "ddp", [ranks((0.1, 4.0), (3.0, 1.0)), ranks((0.2, 4.0), (3.5, 1.0))])
    page = parse(build_report([run], grid=False))
    table = page.table("epoch", "slowest rank", "cause")
    assert [row[:3] for row in table] == [["1", "1", "data"], ["2", "1", "data"]]
    assert table[1][5] == "17.5x"
    assert "Slowest rank: rank 1 (data)" in page.text
    assert "rank 1 has waited for data more than 2x the other ranks' mean for 2 epochs" in page.text

    one = write_run(tmp_path / "single", [ranks((3.0, 1.0)), ranks((3.5, 1.0))])
    text = parse(build_report([one], grid=False)).text
    assert "Slowest rank" not in text and "slowest rank" not in text  # one process: no empty section


def torchrun_slow_rank(data: Path, out: Path, *, slow_rank: int, delay_s: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(ROOT / "tests" / "train" / "slow_decode_train.py"), str(data), "--out", str(out),
               "--model", "resnet18", "--image-size", "32", "--epochs", "2", "--batch-size", "8", "--workers", "0",
               "--device", "cpu", "--quiet", "--no-report"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SLOW_DECODE_RANK": str(slow_rank),
           "SLOW_DECODE_S": str(delay_s)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_two_rank_run_names_the_rank_that_decodes_slowly(image_folder: Path, tmp_path: Path):
    # 48 train images, 24 per rank: rank 1 sleeps 0.1 s per image, about 2.4 s of data wait per epoch.
    result = torchrun_slow_rank(image_folder, tmp_path / "run", slow_rank=1, delay_s=0.1)
    rows = [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")]
    assert [row["epoch"] for row in rows] == [1, 2]
    for row in rows:
        assert row["slowest_rank"] == 1 and row["slowest_rank_cause"] == "data"
        waits = row["rank_wait_s"]
        assert len(waits) == len(row["rank_step_s"]) == 2
        assert waits[1] >= 24 * 0.1 and waits[1] > 2 * waits[0]
        assert row["slowest_rank_wait_s"] == waits[1] and row["others_wait_s"] == waits[0]
        assert row["rank_step_s"][0] > row["rank_step_s"][1]  # rank 0 waits for rank 1 in the all-reduce
    assert "rank 1 has waited for data more than 2x" in result.stderr  # the warning, after epoch 2
