"""The data-wait breakdown by stage: the loop's laps, the per-rank gather, the advice (one rule for the training log
and the run report, ``train.run.diagnose``), and ``stage_seconds`` in every ``metrics.jsonl`` row of a
``train-from-shards`` run."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch.distributed as dist

from train.run.diagnose import dominant_worker_stage, wait_advice
from shards.procs.stage_times import LOOP_STAGES, STAGES, WORKER_STAGES
from tests.train.configs import train_config
from train.run.rows import reads_over_network
from train.run.meter import DataWaitMeter, gather_stage_seconds, sum_stage_seconds
from shards.runrecord import read_rows
from tests.train.test_cli import run_cli


def stages(**seconds: float) -> dict[str, float]:
    return {**dict.fromkeys(STAGES, 0.0), **seconds}


# -- the advice --------------------------------------------------------------------------------------------------
def test_advice_names_decode_with_its_share_of_worker_time():
    breakdown = stages(read=0.5, decode=7.8, transform=1.2, collate=0.5, wait=5.0, step=5.0)
    advice = wait_advice(0.5, 5.0, data_kind="images", workers=2, stages=breakdown, decode="standard")
    assert "decode is 78% of worker time" in advice
    assert "--workers, now 2" in advice and "--decode fast" in advice and "features" in advice
    assert "to_device" not in advice
    fast = wait_advice(0.5, 5.0, data_kind="images", workers=2, stages=breakdown, decode="fast")
    assert "decode is 78%" in fast and "--decode fast" not in fast  # already on it


def test_advice_for_slow_shards_collate_transform_and_copies():
    slow_read = stages(read=6.0, decode=3.0, collate=1.0)
    remote = wait_advice(0.6, 6.0, data_kind="images", workers=4, stages=slow_read, network_reads=True)
    assert "read is 60% of worker time" in remote and "--cache-dir" in remote and "node-local" in remote
    local = wait_advice(0.6, 6.0, data_kind="images", workers=4, stages=slow_read)
    assert "read is 60% of worker time" in local and "--workers, now 4" in local
    assert "--cache-dir" not in local and "local disk" not in local  # already local: neither a cache nor a copy
    collate = wait_advice(0.3, 3.0, data_kind="images", workers=4, stages=stages(read=1.0, decode=1.0, collate=8.0))
    assert "collate is 80% of worker time" in collate and "assemble" in collate
    transform = wait_advice(0.3, 3.0, data_kind="images", workers=4, stages=stages(decode=1.0, transform=3.0))
    assert "transform is 75% of worker time" in transform
    copies = wait_advice(0.3, 3.0, data_kind="images", workers=4,
                         stages=stages(decode=1.0, wait=3.0, to_device=4.0, step=3.0))
    assert "to_device is 40% of the loop's time" in copies and "pin_memory" in copies and "GPU node" in copies


def test_advice_stays_quiet_when_the_pipeline_keeps_up_and_is_generic_without_worker_seconds():
    assert wait_advice(0.2, 9.0, data_kind="images", workers=2, stages=stages(decode=9.0)) is None
    generic = wait_advice(0.45, 4.0, data_kind="features", workers=0, stages=stages(wait=4.0, step=5.0))
    assert "45%" in generic and "--batch-size" in generic
    assert "local disk" not in generic and "--cache-dir" not in generic  # features: in memory or local already
    assert dominant_worker_stage(stages()) is None
    assert dominant_worker_stage(stages(read=1.0, decode=3.0)) == ("decode", 0.75)


def test_a_short_wait_is_no_bottleneck_whatever_its_share():
    # A 0.1 s epoch that spent 60% starting its workers: 60 ms is not worth a word.
    assert wait_advice(0.6, 0.06, data_kind="features", workers=2, stages=stages(read=0.05)) is None
    assert wait_advice(0.6, 1.9, data_kind="images", workers=2, stages=stages(decode=9.0)) is None
    # The same shares over minutes: advice that applies to features held in memory (no cache, no copy).
    features = wait_advice(0.6, 30.0, data_kind="features", workers=2, stages=stages(read=20.0, collate=2.0))
    assert "30.0 s, 60%" in features and "read is 91% of worker time" in features
    assert "--workers, now 2" in features and "--batch-size" in features
    assert "--cache-dir" not in features and "local disk" not in features and "node-local" not in features


def test_only_image_shards_read_over_the_network_can_use_a_cache_or_a_copy():
    def network(path: str, kind: str = "images", **options) -> bool:
        return reads_over_network(train_config(path, "run", **options), kind)

    assert network("s3://bucket/data") and network("https://host/data")
    assert not network("/local/data") and not network("s3://bucket/feat", "features")
    assert not network("s3://bucket/data", images=True)  # decoded images stay in memory after epoch 1
    assert not network("s3://bucket/data", dir="/scratch/cache")  # cached on this node already
    mixed = [{"path": "/local/data"}, {"path": "s3://bucket/more", "weight": 1.0}]
    assert reads_over_network(train_config("/local/data", "run", sources=mixed), "images")


def test_a_tiny_local_feature_run_gets_no_advice_in_its_log_or_its_report(feature_folder: Path, tmp_path: Path):
    # Two workers make the first batches wait for worker start-up: about half of these 0.1-0.4 s epochs, which
    # once read as "the data pipeline is the bottleneck ... use --cache-dir" for data already in memory, and
    # in the report as "... a local disk helps".
    result = run_cli(feature_folder, "--out", tmp_path / "run", "--epochs", "1", "--batch-size", "16",
                     "--workers", "2")
    assert result.exit_code == 0, result.output
    assert "bottleneck" not in result.stderr and "--cache-dir" not in result.stderr and "WARNING" not in result.stderr
    page = (tmp_path / "run" / "report.html").read_text()
    for advice in ("bottleneck", "--cache-dir", "local disk", "node-local"):
        assert advice not in page


# -- the loop's laps and the gather ------------------------------------------------------------------------------
def test_meter_laps_split_the_loop_and_takes_worker_differences_per_epoch():
    now = [0.0]
    workers = [dict.fromkeys(WORKER_STAGES, 0.0)]
    meter = DataWaitMeter(clock=lambda: now[0], worker_stages=lambda: dict(workers[0]))

    def batches():
        for _ in range(2):
            now[0] += 2.0  # blocked waiting
            workers[0]["decode"] += 3.0
            yield None

    workers[0]["read"] = 10.0  # an earlier epoch's seconds: not this epoch's
    meter.start()
    for _ in meter.iterate(batches()):
        now[0] += 0.5
        meter.lap("to_device")
        now[0] += 0.25
        meter.lap("normalize")
        now[0] += 1.0
        meter.lap("step")
    meter.stop()
    workers[0]["decode"] += 100.0  # after stop: the next epoch's
    assert meter.stage_seconds == {"read": 0.0, "decode": 6.0, "transform": 0.0, "collate": 0.0, "wait": 4.0,
                                   "to_device": 1.0, "normalize": 0.5, "step": 2.0}
    assert meter.wall_s == 7.5


def test_gather_without_a_process_group_is_this_rank_alone():
    by_rank = gather_stage_seconds(stages(read=1.0, wait=2.0))
    assert by_rank == [stages(read=1.0, wait=2.0)]
    assert sum_stage_seconds(by_rank + by_rank)["wait"] == 4.0


def _gather_as_rank(rank: int, world: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        results.put((rank, gather_stage_seconds(stages(read=1.0 + rank, wait=10.0 * rank))))
    finally:
        dist.destroy_process_group()


def test_gather_over_two_gloo_ranks_keeps_rank_order(tmp_path: Path):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [context.Process(target=_gather_as_rank, args=(rank, 2, str(tmp_path / "init"), results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    got = dict(results.get(timeout=60) for _ in ranks)
    for process in ranks:
        process.join(30)
        assert process.exitcode == 0
    expected = [stages(read=1.0), stages(read=2.0, wait=10.0)]
    assert got[0] == got[1] == expected


# -- a run writes the breakdown --------------------------------------------------------------------------------
def check_rows(rows: list[dict], world_size: int = 1) -> None:
    for row in rows:
        total, by_rank = row["stage_seconds"], row["stage_seconds_by_rank"]
        assert set(total) == set(STAGES)
        assert len(by_rank) == world_size and all(set(rank) == set(STAGES) for rank in by_rank)
        assert total == pytest.approx(sum_stage_seconds(by_rank))
        # One rank: its wait is the meter's data-wait share of the epoch.
        assert total["wait"] == pytest.approx(row["data_wait_share"] * row["epoch_time_s"], rel=1e-6, abs=1e-9)
        assert sum(total[name] for name in LOOP_STAGES) <= row["epoch_time_s"] * 1.001
        assert total["step"] > 0


def two_checked_epochs(folder: Path, tmp_path: Path, *options: str):
    """A two-epoch run of ``folder``: the CLI result and its metrics rows, each checked by ``check_rows``."""
    result = run_cli(folder, "--out", tmp_path / "run", "--epochs", "2", *options)
    assert result.exit_code == 0, result.output
    rows = [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == 2
    check_rows(rows)
    return result, rows


@pytest.mark.slow
def test_image_run_writes_stage_seconds_in_every_row(image_folder: Path, tmp_path: Path):
    result, rows = two_checked_epochs(image_folder, tmp_path, "--batch-size", "8", "--workers", "2",
                                      "--image-size", "32", "--decode", "fast", "--optimizer", "adamw")
    for row in rows:
        seconds = row["stage_seconds"]
        assert all(seconds[name] > 0 for name in (*WORKER_STAGES, "to_device", "normalize")), seconds
    assert json.loads(result.stdout)["stage_seconds"] == rows[-1]["stage_seconds"]


@pytest.mark.slow
def test_feature_run_reports_read_and_no_decoding(feature_folder: Path, tmp_path: Path):
    _, rows = two_checked_epochs(feature_folder, tmp_path, "--batch-size", "16")
    for row in rows:
        seconds = row["stage_seconds"]
        assert seconds["read"] > 0 and seconds["to_device"] > 0
        assert seconds["decode"] == seconds["transform"] == seconds["collate"] == seconds["normalize"] == 0.0
