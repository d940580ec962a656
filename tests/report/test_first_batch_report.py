"""The run report's time to first batch: one table row per start and resume, the numbers metrics.jsonl holds."""

from __future__ import annotations

from pathlib import Path

from shards.report.build import build_report
from shards.report.html import seconds as shown
from tests.report.conftest import read_rows, write_rows
from tests.report.page import parse

HEADER = ("start", "at", "first batch", "open", "plan", "first read", "other")


def test_the_stage_breakdown_shows_the_runs_first_batch(trained_root: Path):
    run = trained_root / "run"
    [record] = read_rows(run)[0]["first_batch"]
    [row] = parse(build_report([run], grid=False)).table(*HEADER)
    assert row[:7] == ["start", "epoch 1, step 0", shown(record["first_batch_s"]), shown(record["open_s"]),
                       shown(record["plan_s"]), shown(record["first_read_s"]), shown(record["other_s"])]


def test_a_resume_gets_its_own_row_and_malformed_records_are_left_out(run_copy: Path):
    rows = read_rows(run_copy)
    start = rows[0]["first_batch"][0]
    resume = {**start, "resume": True, "epoch": 2, "step": 5, "first_batch_s": 2.5, "open_s": 0.25}
    rows[1]["first_batch"] = [resume, {"first_batch_s": "soon"}, "not a record"]
    write_rows(run_copy, rows)
    table = parse(build_report([run_copy], grid=False)).table(*HEADER)
    assert [r[:4] for r in table] == [["start", "epoch 1, step 0", shown(start["first_batch_s"]),
                                       shown(start["open_s"])],
                                      ["resume", "epoch 2, step 5", "2.500 s", "0.250 s"]]


def test_a_run_from_before_first_batch_timing_has_no_table(run_copy: Path):
    write_rows(run_copy, [{k: v for k, v in row.items() if k != "first_batch"} for row in read_rows(run_copy)])
    html = build_report([run_copy], grid=False)
    assert "Time to first batch" not in html
