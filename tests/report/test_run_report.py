"""The run section: numbers as in metrics.jsonl, what the run was trained on, the stage breakdown (single process,
older runs, several ranks), checkpoints, and a report rewritten safely at the end of every epoch."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from shards.errors import InputError
from shards.report.build import REPORT_FILE, build_report, make_report, write_run_report
from shards.units import human_bytes
from tests.report.conftest import CLASSES, read_rows, write_rows
from tests.report.page import external_references, http_mentions, parse, tiles

STAGES = ("read", "decode", "transform", "collate", "wait", "to_device", "normalize", "step")


def test_headline_and_epoch_table_equal_metrics_jsonl(trained_root: Path):
    run = trained_root / "run"
    rows = read_rows(run)
    html = build_report([run], grid=False)
    page = parse(html)
    assert page.unbalanced == [] and external_references(html) == [] and http_mentions(html) == []
    last = rows[-1]
    headline = tiles(html)
    assert headline[f"val top-1, epoch {last['epoch']}"] == f"{100 * last['val_top1']:.2f}%"
    assert headline["epochs"] == "2 / 2"
    assert headline["val loss"] == f"{last['val_loss']:.4f}"
    best = max(rows, key=lambda row: (row["val_top1"], -row["epoch"]))
    assert headline[f"best val top-1 (epoch {best['epoch']})"] == f"{100 * best['val_top1']:.2f}%"
    table = page.table("epoch", "train loss", "val loss", "train top-1", "val top-1")
    assert [r[:5] for r in table] == [[str(row["epoch"]), f"{row['train_loss']:.4f}", f"{row['val_loss']:.4f}",
                                       f"{100 * row['train_top1']:.2f}%", f"{100 * row['val_top1']:.2f}%"]
                                      for row in rows]


def test_per_class_accuracy_and_confusion_use_the_manifest_class_names(trained_root: Path):
    run = trained_root / "run"
    last = read_rows(run)[-1]
    report = make_report([run], grid=False)
    assert [s.kind for s in report.sections] == ["run", "features", "dataset"]
    page = parse(report.html())
    per_class = page.table("class", "val top-1", "val samples")
    assert [row[0] for row in per_class] == list(CLASSES)
    confusion = last["val_confusion"]
    for row, name, counts in zip(per_class, CLASSES, confusion):
        assert row[1] == f"{100 * last['val_per_class_accuracy'][name]:.2f}%"
        assert row[2] == f"{sum(counts):,}"
    html = report.html()
    for i, counts in enumerate(confusion):
        for j, value in enumerate(counts):
            tip = f"true {CLASSES[i]}, predicted {CLASSES[j]}: {value:,}"
            assert tip in html  # every cell of the heat map carries its count


def test_a_run_links_the_features_it_was_trained_on(trained_root: Path):
    report = make_report([trained_root / "run"], grid=False)
    page = parse(report.html())
    run_link, dataset_link = f"#{report.sections[1].anchor}", f"#{report.sections[2].anchor}"
    assert run_link in page.references and dataset_link in page.references
    assert {s.anchor for s in report.sections} <= set(page.ids)
    # Given twice, directly and through the run, a folder still gets one section.
    again = make_report([trained_root / "run", trained_root / "cache" / "features"], grid=False)
    assert [s.kind for s in again.sections] == ["run", "features", "dataset"]


def test_a_run_whose_data_is_gone_still_reports(run_copy: Path, tmp_path: Path):
    config = json.loads((run_copy / "config.json").read_text())
    config["data"]["path"] = str(tmp_path / "moved-away")
    (run_copy / "config.json").write_text(json.dumps(config))
    report = make_report([run_copy])
    assert [s.kind for s in report.sections] == ["run"]
    text = parse(report.html()).text
    assert "is not included" in text and "moved-away" in text
    assert "class names from metrics.jsonl" in text  # the per-class keys, in class order


def test_stage_breakdown_of_a_single_process_run(run_copy: Path):
    rows = read_rows(run_copy)
    for epoch, row in enumerate(rows, 1):
        row["stage_seconds"] = {stage: 0.5 * epoch + i for i, stage in enumerate(STAGES)}
        row.pop("stage_seconds_by_rank", None)
    write_rows(run_copy, rows)
    page = parse(build_report([run_copy], grid=False))
    shares = page.table("stage", "part", "seconds", "share of part")
    last = rows[-1]["stage_seconds"]
    loop = sum(last[s] for s in ("wait", "to_device", "normalize", "step"))
    assert shares[4] == ["wait", "loop", f"{last['wait']:.3f} s", f"{100 * last['wait'] / loop:.1f}%"]
    assert [row[0] for row in shares] == list(STAGES)
    assert "per rank" not in page.text


def test_an_older_run_without_stage_timing_says_not_recorded(run_copy: Path):
    rows = read_rows(run_copy)
    for row in rows:
        row.pop("stage_seconds", None)
        row.pop("stage_seconds_by_rank", None)
    write_rows(run_copy, rows)
    text = parse(build_report([run_copy], grid=False)).text
    assert "Not recorded: this run's metrics.jsonl has no stage_seconds" in text


def test_a_distributed_run_shows_each_rank(run_copy: Path):
    """Metrics rows as a 2-rank run writes them (``stage_seconds`` summed over ranks, ``stage_seconds_by_rank`` in
    rank order), faked on a one-process run: running torchrun here would add a minute and test nothing more."""
    from train.run.diagnose import straggler_fields

    rows = read_rows(run_copy)
    for row in rows:
        ranks = [{stage: 1.0 + i for i, stage in enumerate(STAGES)},
                 {stage: 2.0 + i for i, stage in enumerate(STAGES)}]
        ranks[1]["wait"] = 9.0  # rank 1 starves
        row["stage_seconds_by_rank"] = ranks
        row["stage_seconds"] = {s: ranks[0][s] + ranks[1][s] for s in STAGES}
        row.update(straggler_fields(ranks))  # what the loop records beside them
    write_rows(run_copy, rows)
    page = parse(build_report([run_copy], grid=False))
    assert "per rank (2 ranks)" in page.text
    by_rank = page.table("rank", *STAGES)
    assert [row[0] for row in by_rank] == ["0", "1"]
    assert by_rank[1][1:9] == [f"{rows[-1]['stage_seconds_by_rank'][1][s]:.3f} s" for s in STAGES]
    loop1 = 9.0 + 7.0 + 8.0 + 9.0
    assert by_rank[1][-1] == f"{100 * 9.0 / loop1:.1f}%"
    assert "Slowest rank: rank 1 (data)" in page.text  # as recorded (train.run.diagnose)


def test_the_report_shows_the_loops_recorded_findings_and_applies_no_rule_of_its_own(run_copy: Path):
    """The advice and the straggler warning are what the training loop recorded in the epoch row
    (``train.run.diagnose``): the report shows them as written, and a row without them shows none, however its
    numbers look."""
    rows = read_rows(run_copy)
    for row in rows:
        row["epoch_time_s"], row["data_wait_share"] = 60.0, 0.6  # 36 s waiting: the rule would advise
        row["stage_seconds"] = {**dict.fromkeys(STAGES, 0.0), "read": 30.0, "wait": 36.0, "step": 20.0}
    write_rows(run_copy, rows)
    html = build_report([run_copy], grid=False)
    warn_tile = '<div class="tile warn"><div class="value">60.0%</div><div class="label">data wait</div>'
    assert "bottleneck" not in html and warn_tile not in html and tiles(html)["data wait"] == "60.0%"

    rows[-1]["wait_advice"] = "recorded <advice>: use --cache-dir"
    rows[-1]["straggler_warning"] = "recorded warning about rank 3"
    write_rows(run_copy, rows)
    html = build_report([run_copy], grid=False)
    text = parse(html).text
    assert "Epoch 2: recorded <advice>: use --cache-dir." in text and warn_tile in html
    assert "Epoch 2: recorded warning about rank 3." in text


def test_checkpoints_are_listed_with_sizes_and_epochs(trained_root: Path):
    run = trained_root / "run"
    rows = read_rows(run)
    best = max(rows, key=lambda row: (row["val_top1"], -row["epoch"]))["epoch"]
    listed = {Path(row[0]).name: row for row in parse(build_report([run], grid=False)).table("file", "size", "epoch")}
    for name in ("last.pt", "best.pt", "model.pt"):
        assert listed[name][1] == human_bytes((run / name).stat().st_size)
    assert listed["best.pt"][2] == f"epoch {best}" and listed["last.pt"][2] == "after epoch 2"


def test_cache_counters_get_their_own_charts(run_copy: Path):
    rows = read_rows(run_copy)
    for row, rate in zip(rows, (0.0, 0.75)):
        row["cache_hit_rate"], row["fetched_bytes"] = rate, 1 << 20
    write_rows(run_copy, rows)
    html = build_report([run_copy], grid=False)
    assert tiles(html)["cache hit rate"] == "75.0%"
    assert "Node-local shard cache" in parse(html).text


def test_damaged_metrics_lines_are_named_and_skipped(run_copy: Path):
    rows = read_rows(run_copy)
    rows[0]["val_top1"] = "<b>not a number</b>"
    write_rows(run_copy, rows)
    with open(run_copy / "metrics.jsonl", "a") as handle:
        handle.write("{truncated\n")
    html = build_report([run_copy], grid=False)
    page = parse(html)
    assert page.unbalanced == []
    assert "metrics.jsonl line 1: val_top1 is '<b>not a number</b>': expected a number; left out" in page.text
    assert re.search(r"metrics\.jsonl line 3 is not a JSON object \([^)]*\); left out", page.text)
    assert [row[0] for row in page.table("epoch", "train loss", "val loss", "train top-1", "val top-1")] == ["2"]


def test_write_run_report_replaces_the_page_atomically(run_copy: Path):
    first = write_run_report(run_copy)
    assert first == run_copy / REPORT_FILE and first.is_file()
    before = first.stat().st_ino
    rows = read_rows(run_copy)
    write_rows(run_copy, rows + [dict(rows[-1], epoch=3, val_top1=0.5)])
    write_run_report(run_copy)
    assert first.stat().st_ino != before  # a new file renamed over the old: readers never see half a page
    assert tiles(first.read_text())["val top-1, epoch 3"] == "50.00%"
    assert [p.name for p in run_copy.iterdir() if p.name.endswith(".tmp")] == []


def test_write_run_report_refuses_a_folder_that_is_not_a_run(feature_dir: Path):
    with pytest.raises(InputError, match="not a training run"):
        write_run_report(feature_dir)
    assert not (feature_dir / REPORT_FILE).exists()
    assert os.listdir(feature_dir)


def test_quarantined_samples_are_named_from_the_runs_data_events(run_copy: Path):
    from shards.data_events import append_event

    assert "sample(s) quarantined" not in parse(build_report([run_copy], grid=False)).text
    for i in range(12):
        append_event(run_copy, {"kind": "quarantine", "epoch": 1, "step": 3 + i, "rank": 0, "key": f"<b>k{i}</b>",
                                "shard": "train-000000.tar", "row": i, "reason": "stall"})
    page = parse(build_report([run_copy], grid=False))
    assert page.unbalanced == []  # the untrusted keys are escaped, not markup
    assert "12 sample(s) quarantined" in page.text
    assert "<b>k0</b> (train-000000.tar, stall, epoch 1)" in page.text and "and 2 more" in page.text
    assert "<b>k11</b>" not in page.text  # beyond the ten named; data-events.jsonl lists them all
