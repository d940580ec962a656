"""The run report's "Storage: forecast vs measured" table: each epoch's forecast beside what the run measured, as
metrics.jsonl records them, and nothing for a run without a forecast."""

from __future__ import annotations

from pathlib import Path

from shards.report.build import build_report
from tests.report.conftest import read_rows, write_rows
from tests.report.page import parse

HEADER = ("epoch", "requests: forecast", "measured", "off by", "bytes: forecast", "measured", "off by")


def test_each_epoch_shows_the_forecast_beside_the_measurement(run_copy: Path):
    rows = read_rows(run_copy)
    rows[0]["forecast"] = {"requests": 200, "bytes": 4 << 20, "hits": 0, "misses": 10, "first_batch_s": 0.25}
    rows[0]["storage"] = {"requests": 210, "bytes": 4 << 20, "hits": 0, "misses": 10}
    rows[1]["forecast"] = {"requests": 0, "bytes": 0, "hits": 10, "misses": 0}
    rows[1]["storage"] = {"requests": 3, "bytes": 1024, "hits": 10, "misses": 0}
    write_rows(run_copy, rows)
    page = parse(build_report([run_copy], grid=False))
    assert page.unbalanced == []
    assert "Storage: forecast vs measured" in page.text
    table = page.table(*HEADER)
    assert table[0][:7] == ["1", "200", "210", "+5.0%", "4.0 MiB", "4.0 MiB", "+0.0%"]
    assert table[1][1:4] == ["0", "3", "n/a"]  # nothing forecast: no ratio to show
    assert table[0][7:13] == ["0", "0", "n/a", "10", "10", "+0.0%"]  # cache hits, then misses


def test_a_run_without_a_forecast_has_no_such_table(run_copy: Path):
    rows = read_rows(run_copy)
    for row in rows:  # a run whose forecast could not be made (the trained run's feature rows have one)
        row.pop("forecast", None)
    write_rows(run_copy, rows)
    assert "forecast vs measured" not in parse(build_report([run_copy], grid=False)).text


def test_an_odd_forecast_value_is_shown_as_missing_not_trusted(run_copy: Path):
    rows = read_rows(run_copy)
    rows[0]["forecast"] = {"requests": "many", "bytes": 10}
    rows[0]["storage"] = {"requests": 5, "bytes": [1]}
    write_rows(run_copy, rows)
    page = parse(build_report([run_copy], grid=False))
    assert page.table(*HEADER)[0][:7] == ["1", "n/a", "5", "n/a", "10 B", "n/a", "n/a"]
