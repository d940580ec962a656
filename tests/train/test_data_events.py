"""The data events file: appended line by line, read back whole, a torn last line left out."""

from __future__ import annotations

import json

import pytest

from shards.data_events import EVENTS_FILE, append_event, read_events


def test_events_round_trip_in_order_across_rank_files(tmp_path):
    append_event(tmp_path, {"kind": "layout", "epoch": 1, "step": 0, "rank": 0, "time": 1.0, "loader_state": None})
    append_event(tmp_path, {"kind": "quarantine", "epoch": 1, "step": 3, "rank": 1, "time": 2.0, "key": "a/1"})
    append_event(tmp_path, {"kind": "exclude", "epoch": 1, "step": 5, "rank": 0, "time": 3.0, "count": 2})
    assert [e["kind"] for e in read_events(tmp_path)] == ["layout", "quarantine", "exclude"]
    assert (tmp_path / "data-events.rank1.jsonl").exists()
    assert len((tmp_path / EVENTS_FILE).read_text().splitlines()) == 2


def test_time_is_filled_in_and_kind_is_required(tmp_path):
    append_event(tmp_path, {"kind": "restart", "epoch": 1, "step": 0, "rank": 0})
    assert isinstance(read_events(tmp_path)[0]["time"], float)
    with pytest.raises(ValueError, match="kind"):
        append_event(tmp_path, {"epoch": 1})


def test_a_torn_last_line_is_ignored_and_the_next_append_is_whole(tmp_path):
    append_event(tmp_path, {"kind": "layout", "epoch": 1, "step": 0, "rank": 0, "time": 1.0})
    with open(tmp_path / EVENTS_FILE, "a") as handle:
        handle.write('{"kind": "quaran')  # a writer killed mid-line
    assert [e["kind"] for e in read_events(tmp_path)] == ["layout"]
    append_event(tmp_path, {"kind": "exclude", "epoch": 2, "step": 9, "rank": 0, "time": 2.0})
    assert [e["kind"] for e in read_events(tmp_path)] == ["layout", "exclude"]
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert json.loads(lines[-1])["kind"] == "exclude"


def test_no_file_is_no_events(tmp_path):
    assert read_events(tmp_path) == []
    assert read_events(tmp_path / "absent") == []
