"""The loader's memory in flight over an epoch beside its data wait (``train.run.meter.MemoryTrace``): sampled as
batches arrive, never more often than asked, thinned to a bounded row, and recorded in every ``metrics.jsonl`` row
of a run with the budget it was held to (issue 46)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from shards.procs.memory import TreeMemory, tree_memory, tree_pss_bytes
from shards.runrecord import RECORD_FILE, read_rows
from tests.train.test_cli import run_cli
from train.run.meter import DataWaitMeter, MemoryTrace

MIB = 1 << 20


def _reading(total: int) -> TreeMemory:
    """A reading of ``total`` bytes, a tenth of them the training process's own, the rest its workers'."""
    return TreeMemory(own=total // 10, descendants=total - total // 10, shm=0)


def _epoch(meter: DataWaitMeter, now: list[float], arrive_s: list[float], step_s: float) -> None:
    """Batches that take ``arrive_s[i]`` seconds to arrive, each trained ``step_s`` seconds, on a fake clock."""
    _epoch_without_stop(meter, now, arrive_s, step_s)
    meter.stop()


def test_samples_the_start_the_first_batch_then_every_interval_with_each_intervals_wait():
    now, memory = [0.0], iter(range(100, 10_000, 10))
    trace = MemoryTrace(read=lambda: _reading(next(memory)), every_s=4.0, background=False)
    meter = DataWaitMeter(clock=lambda: now[0], memory=trace)
    _epoch(meter, now, [2.0] + [0.5] * 8, step_s=1.5)  # batches arrive at 2, 4, 6 ... 18 s; the end at 19.5 s
    record = trace.record(budget_bytes=64)
    # the baseline, the first batch, then the first batch at least 4 s after the last sample, and the end
    assert record["t_s"] == [0.0, 2.0, 6.0, 10.0, 14.0, 18.0, 19.5]
    assert record["bytes"] == [100, 110, 120, 130, 140, 150, 160] and record["start_bytes"] == 100
    assert record["main_bytes"] == [10, 11, 12, 13, 14, 15, 16]
    assert record["peak_flight_bytes"] == 60 and record["budget_bytes"] == 64
    assert record["wait_share"][:3] == [None, 1.0, 0.25]  # 2 arrivals of 0.5 s in the 4 s after the first
    assert json.loads(json.dumps(record)) == record  # a metrics.jsonl value as it is


def test_a_long_epoch_is_thinned_to_a_bounded_trace_that_keeps_its_baseline():
    now, memory = [0.0], iter(range(1, 100_000))
    trace = MemoryTrace(read=lambda: _reading(next(memory)), every_s=1.0, max_samples=10, background=False)
    _epoch(DataWaitMeter(clock=lambda: now[0], memory=trace), now, [0.25] * 400, step_s=0.25)
    record = trace.record()
    assert len(record["t_s"]) <= 10 and record["t_s"][0] == 0.0 and record["bytes"][0] == 1
    assert len(record["main_bytes"]) == len(record["t_s"]) == len(record["wait_share"])
    assert record["t_s"] == sorted(record["t_s"]) and trace.every_s > 1.0
    assert all(0.45 <= share <= 0.55 for share in record["wait_share"][1:])  # half of every interval is waiting


def test_reads_run_beside_the_loop_one_at_a_time():
    """The first batch's read is held until the loop has taken every batch: the loop never waits for it, and the
    batches that arrive meanwhile are not sampled."""
    entered, release, released_by_test, reads = threading.Event(), threading.Event(), [], []

    def held_read():
        reads.append(len(reads))
        if len(reads) == 2:
            entered.set()
            released_by_test.append(release.wait(30))  # False: the loop waited for this read until the timeout
        return _reading(100 * len(reads))

    now = [0.0]
    trace = MemoryTrace(read=held_read, every_s=1.0)
    meter = DataWaitMeter(clock=lambda: now[0], memory=trace)
    _epoch_without_stop(meter, now, [2.0] * 5, step_s=1.0)
    assert entered.wait(30) and len(reads) == 2  # batches 2-5 found the read in flight
    release.set()
    meter.stop()
    record = trace.record()
    assert released_by_test == [True]
    assert record["t_s"] == [0.0, 2.0, 15.0] and record["bytes"] == [100, 200, 300]


def _epoch_without_stop(meter: DataWaitMeter, now: list[float], arrive_s: list[float], step_s: float) -> None:
    def batches():
        for seconds in arrive_s:
            now[0] += seconds
            yield torch.zeros(1)

    meter.start()
    for _ in meter.iterate(batches()):
        now[0] += step_s


def test_a_kernel_without_pss_records_nothing():
    now = [0.0]
    trace = MemoryTrace(read=lambda: None, background=False)
    _epoch(DataWaitMeter(clock=lambda: now[0], memory=trace), now, [1.0] * 3, step_s=1.0)
    assert trace.record() is None


@pytest.mark.skipif(tree_pss_bytes() is None, reason="the kernel gives no smaps_rollup")
def test_the_tree_counts_the_worker_processes():
    import multiprocessing

    alone = tree_memory(None)
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_hold, args=(context.Event(),), daemon=True)
    child.start()
    try:
        _wait_for_child(child.pid)
        reading = tree_memory(None)  # /dev/shm is the machine's: other processes move it, so PSS alone is compared
        assert reading.descendants > max(4 * MIB, alone.descendants)
    finally:
        child.terminate()
        child.join()


def _hold(event) -> None:
    event.wait(30)


def _wait_for_child(pid: int) -> None:
    import time

    for _ in range(200):  # until the child's interpreter is up (its PSS past a bare exec's)
        if (tree_pss_bytes(pid) or 0) > 4 * MIB:
            return
        time.sleep(0.05)


@pytest.mark.skipif(tree_pss_bytes() is None, reason="the kernel gives no smaps_rollup")
def test_every_row_of_a_run_carries_its_memory_in_flight_and_the_budget(image_folder: Path, tmp_path: Path):
    out = tmp_path / "run"
    result = run_cli(image_folder, "--out", out, "--epochs", "2", "--batch-size", "4", "--image-size", "32",
                     "--decode", "fast", "--workers", "2", "--memory-budget", "256M")
    assert result.exit_code == 0, result.output
    rows = [row.to_json() for row in read_rows(out / "metrics.jsonl")]
    budget = json.loads((out / RECORD_FILE).read_text())["memory_budget"]["bytes"]
    assert budget == 256 * MIB
    for row in rows:
        memory = row["memory"]
        assert memory["budget_bytes"] == budget and memory["measure"] == "pss+shm"
        assert len(memory["t_s"]) == len(memory["bytes"]) == len(memory["main_bytes"]) == len(memory["wait_share"]) >= 3
        assert all(0 < main < whole for main, whole in zip(memory["main_bytes"], memory["bytes"]))
        assert memory["t_s"][0] == 0.0 and memory["t_s"] == sorted(memory["t_s"])
        assert all(b > 0 for b in memory["bytes"]) and memory["start_bytes"] == memory["bytes"][0]
        assert memory["peak_flight_bytes"] == max(0, max(memory["bytes"]) - memory["start_bytes"])
        assert all(share is None or 0.0 <= share <= 1.0 for share in memory["wait_share"])
    # the first epoch starts its two worker processes: they are in the tree it measures
    assert rows[0]["memory"]["peak_flight_bytes"] > 8 * MIB
    report = (out / "report.html").read_text()
    assert "Memory in flight and data wait" in report and "in flight (peak)" in report
