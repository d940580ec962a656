"""The run report's memory in flight beside the data wait (``shards.report.memory``): a trained run's rows carry
the trace, the per-epoch table shows each epoch's peak next to its data wait, the last traced epoch is drawn as
memory over time beside the wait of the same intervals, and a row without a trace (or with a broken one) leaves
them out instead of failing."""

from __future__ import annotations

from pathlib import Path

import pytest

from shards.procs.memory import tree_pss_bytes
from shards.report.build import build_report
from shards.units import human_bytes
from tests.report.conftest import read_rows, write_rows
from tests.report.page import parse

MIB = 1 << 20
SECTION = "Memory in flight and data wait"


def _trace(start: int, flight: list[int], budget: int | None) -> dict:
    return {"measure": "pss+shm", "every_s": 5.0, "start_bytes": start, "budget_bytes": budget,
            "peak_flight_bytes": max(flight), "t_s": [5.0 * i for i in range(len(flight))],
            "bytes": [start + value for value in flight], "wait_share": [None] + [0.25] * (len(flight) - 1)}


@pytest.mark.skipif(tree_pss_bytes() is None, reason="the kernel gives no smaps_rollup")
def test_a_trained_run_records_its_memory_and_the_report_shows_it_beside_the_data_wait(trained_root: Path):
    run = trained_root / "run"
    rows = read_rows(run)
    assert all(len(row["memory"]["t_s"]) >= 3 and row["memory"]["start_bytes"] > 0 for row in rows)
    page = parse(build_report([run], grid=False))
    headers = next(table[0] for table in page.tables if table and table[0][:1] == ["epoch"])
    assert headers[headers.index("data wait") + 1] == "in flight (peak)"
    column = [body[headers.index("in flight (peak)")] for body in page.table(*headers)]
    assert column == [human_bytes(row["memory"]["peak_flight_bytes"]) for row in rows]
    assert SECTION in page.text


def test_the_chart_draws_the_flight_over_time_with_the_budget_and_the_wait_of_each_interval(run_copy: Path):
    rows = read_rows(run_copy)
    rows[0]["memory"] = _trace(900 * MIB, [0, 40 * MIB, 10 * MIB], 48 * MIB)
    rows[1]["memory"] = _trace(900 * MIB, [0, 30 * MIB, 36 * MIB, 20 * MIB], 48 * MIB)
    write_rows(run_copy, rows)
    html = build_report([run_copy], grid=False)
    page = parse(html)
    headers = ["epoch", "train loss", "val loss", "train top-1", "val top-1", "lr", "samples/s", "data wait",
               "in flight (peak)"]
    assert [body[8] for body in page.table(*headers)] == [human_bytes(40 * MIB), human_bytes(36 * MIB)]
    assert SECTION in page.text and f"budget {human_bytes(48 * MIB)}" in html  # the budget's line, in sight
    assert f"Epoch 2: peak {human_bytes(36 * MIB)} in flight of a {human_bytes(48 * MIB)} budget" in page.text
    assert f"10: {human_bytes(36 * MIB)}" in html and "10: 25%" in html  # the same interval, memory and wait


def test_the_flight_is_split_between_the_training_process_and_its_workers(run_copy: Path):
    rows = read_rows(run_copy)
    rows[-1]["memory"] = {**_trace(900 * MIB, [0, 40 * MIB, 30 * MIB], 48 * MIB),
                          "main_bytes": [500 * MIB, 510 * MIB, 505 * MIB]}
    write_rows(run_copy, rows)
    html = build_report([run_copy], grid=False)
    assert f"5 \u00b7 training process: {human_bytes(10 * MIB)}" in html
    assert f"5 \u00b7 worker processes, /dev/shm: {human_bytes(30 * MIB)}" in html
    assert f"10 \u00b7 worker processes, /dev/shm: {human_bytes(25 * MIB)}" in html


def test_a_budget_far_above_the_flight_is_stated_not_drawn(run_copy: Path):
    rows = read_rows(run_copy)
    rows[-1]["memory"] = _trace(900 * MIB, [0, 2 * MIB, MIB], 16 << 30)
    write_rows(run_copy, rows)
    html = build_report([run_copy], grid=False)
    assert f"budget {human_bytes(16 << 30)}" not in html
    assert f"in flight of a {human_bytes(16 << 30)} budget" in parse(html).text


@pytest.mark.parametrize("broken", [None, {"t_s": [0, 1], "bytes": [1], "start_bytes": 1},
                                    {"t_s": [0, "x"], "bytes": [1, 2], "start_bytes": 1},
                                    {"t_s": [0, 1], "bytes": [1, 2]}, ["not", "a", "trace"]])
def test_a_run_without_a_trace_or_with_a_broken_one_leaves_it_out(run_copy: Path, broken):
    rows = read_rows(run_copy)
    for row in rows:
        row.pop("memory", None)
        if broken is not None:
            row["memory"] = broken
    write_rows(run_copy, rows)
    page = parse(build_report([run_copy], grid=False))
    assert SECTION not in page.text and page.unbalanced == []
    if isinstance(broken, list):  # not an object: the row is not an EpochRow, said on the page
        assert "memory" in page.text and "left out" in page.text
