"""The run report's run-mode table: with ``Auto``, each candidate's trial, which were cut short, which two ran off
and which was chosen, from what metrics.jsonl holds (older runs without a runoff or a cut, and malformed records,
read as far as they go)."""

from __future__ import annotations

from pathlib import Path

from shards.report.build import build_report
from tests.report.conftest import read_rows, write_rows
from tests.report.page import parse

HEADER = ("candidate", "batches timed", "mean step", "mean data wait", "")
PROCESSES, THREADS, WIDE = "WorkerProcesses(workers=2)", "Threads(workers=2)", "Threads(workers=2, decoders=4)"


def with_run_mode(run: Path, run_mode: dict) -> str:
    rows = read_rows(run)
    rows[-1]["run_mode"] = run_mode
    write_rows(run, rows)
    return build_report([run], grid=False)


def trial(*batches: int) -> list[dict]:
    return [{"mode": mode, "batches": n, "step_s": 0.05 + i / 100, "wait_s": 0.01}
            for i, (mode, n) in enumerate(zip((PROCESSES, THREADS, WIDE), batches))]


def test_the_two_that_ran_off_and_the_one_chosen_are_marked(run_copy: Path):
    html = with_run_mode(run_copy, {"mode": "Auto(workers=2)", "trial": trial(20, 20, 10),
                                    "runoff": [PROCESSES, THREADS], "chosen": PROCESSES})
    table = parse(html).table(*HEADER)
    assert [(row[0], row[1], row[4]) for row in table] == [(PROCESSES, "20", "ran off, chosen"),
                                                           (THREADS, "20", "ran off"), (WIDE, "10", "")]
    assert "of the two ran off" in html


def test_a_trial_without_a_runoff_or_from_before_it_marks_only_the_choice(run_copy: Path):
    for extra in ({"runoff": []}, {}, {"runoff": "not a list"}, {"runoff": [3, None]}):
        html = with_run_mode(run_copy, {"mode": "Auto(workers=2)", "trial": trial(10, 10, 10), "chosen": THREADS,
                                        **extra})
        table = parse(html).table(*HEADER)
        assert [row[4] for row in table] == ["", "chosen", ""]
        assert "ran off" not in html


def test_a_candidate_cut_short_is_marked_and_said_why(run_copy: Path):
    html = with_run_mode(run_copy, {"mode": "Auto(workers=2)", "trial": trial(10, 10, 3), "cut": [WIDE],
                                    "runoff": [], "chosen": PROCESSES})
    table = parse(html).table(*HEADER)
    assert [(row[1], row[4]) for row in table] == [("10", "chosen"), ("10", ""), ("3", "cut short")]
    assert "half again as slow" in html
    for extra in ({}, {"cut": "not a list"}, {"cut": [7]}):  # runs from before the cut, or malformed
        html = with_run_mode(run_copy, {"mode": "Auto(workers=2)", "trial": trial(10, 10, 10), "chosen": THREADS,
                                        **extra})
        assert [row[4] for row in parse(html).table(*HEADER)] == ["", "chosen", ""] and "cut short" not in html
