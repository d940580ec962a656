"""The run report's data mixture: config.json's recorded composition as a table per source, metrics.jsonl's
per-epoch draws as a stacked chart and a table, untrusted values shown safely, and nothing for a plain run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import shards
from shards.report.build import build_report
from shards.select.mixture import SourceSpec, Subset
from tests.helpers import make_shard_dataset
from tests.report.conftest import write_rows
from tests.report.page import external_references, http_mentions, parse

SOURCE_HEADER = ("source", "path", "amount", "subset", "available", "drawn per epoch", "share", "passes", "shards")


@pytest.fixture
def composition(tmp_path: Path) -> list[dict]:
    """What train-from-shards records: the composition of a weighted mixture, one source a class subset."""
    make_shard_dataset(tmp_path / "A", classes=("a", "b", "c"), shard_sizes={"train": [6, 6, 4]}, size=(8, 8))
    make_shard_dataset(tmp_path / "B", classes=("a", "b", "c"), shard_sizes={"train": [5, 5]}, size=(8, 8))
    specs = [SourceSpec(str(tmp_path / "A"), weight=0.7),
             SourceSpec(str(tmp_path / "B"), weight=0.3, subset=Subset(classes=["a"]))]
    dataset = shards.open_dataset(specs, "train", cache="none", mix=shards.MixOptions(epoch_size=20),
                                  distributed=shards.Distributed(rank=0, world_size=1))
    return dataset.mixture.composition(["a", "b", "c"])


def write_run(folder: Path, config: dict, rows: list[dict]) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"run": {"out_dir": str(folder)}, "optim": {"epochs": len(rows)},
                                                    **config}))
    write_rows(folder, rows)
    return folder


def epoch_row(epoch: int, drawn: list) -> dict:
    return {"epoch": epoch, "train_loss": 1.0 / epoch, "val_loss": 1.2 / epoch, "train_top1": 0.5, "val_top1": 0.5,
            "lr": 0.1, "mixture_drawn": drawn}


def test_the_mixture_is_shown_per_source_and_per_epoch(tmp_path: Path, composition: list[dict]):
    run = write_run(tmp_path / "run", {"mixture": {"class_map": "same", "epoch_size": 20, "sources": composition}},
                    [epoch_row(1, [14, 6]), epoch_row(2, [14, 6])])
    html = build_report([run], grid=False)
    page = parse(html)
    assert page.unbalanced == [] and external_references(html) == [] and http_mentions(html) == []
    assert "Data mixture" in page.text
    assert "2 sources, 20 samples per epoch. Class map: same (every source has the same class list)." in page.text
    assert page.table(*SOURCE_HEADER) == [
        ["1 A", str(tmp_path / "A"), "weight 0.7", "all", "16", "14", "70.0%", "0.88", "3"],
        ["2 B", str(tmp_path / "B"), "weight 0.3", "classes a", "4", "6", "30.0%", "1.50", "2"]]
    assert page.table("class", "1 A", "2 B", "total") == [["a", "6", "4", "10"], ["b", "5", "n/a", "5"],
                                                         ["c", "5", "n/a", "5"]]
    assert page.table("epoch", "1 A", "2 B", "total") == [["1", "14", "6", "20"], ["2", "14", "6", "20"]]
    assert "1 A: 14" in html and "2 B: 6" in html  # the stacked chart's tooltips, epoch by epoch
    assert "drew other amounts" not in page.text
    assert '"sources"' not in html  # shown as a section, not again as one JSON value in the config grid


@pytest.mark.slow  # over half a second in the quick loop
def test_epochs_that_drew_other_amounts_are_named(tmp_path: Path, composition: list[dict]):
    run = write_run(tmp_path / "run", {"mixture": {"class_map": "same", "epoch_size": 20, "sources": composition}},
                    [epoch_row(1, [14, 6]), epoch_row(2, [13, 7])])
    assert "Epoch 2 drew other amounts than config.json's mixture records per epoch." in parse(
        build_report([run], grid=False)).text


def test_per_epoch_draws_alone_are_named_by_position(tmp_path: Path):
    run = write_run(tmp_path / "run", {}, [epoch_row(1, [5, 3, 2])])
    page = parse(build_report([run], grid=False))
    assert page.table("epoch", "source 1", "source 2", "source 3", "total") == [["1", "5", "3", "2", "10"]]


@pytest.mark.slow  # over half a second in the quick loop
def test_a_damaged_mixture_entry_is_named_and_untrusted_text_is_escaped(tmp_path: Path, composition: list[dict]):
    hostile = dict(composition[0], path="<script>alert(1)</script>", weight="heavy", share="most", available=None)
    run = write_run(tmp_path / "run", {"mixture": {"class_map": "<b>x</b>", "sources": [hostile]}},
                    [epoch_row(1, ["many"])])
    html = build_report([run], grid=False)
    page = parse(html)
    assert page.unbalanced == [] and "alert(1)" not in "".join(page.scripts)
    assert page.table(*SOURCE_HEADER)[0][:7] == ["1 script>", "<script>alert(1)</script>", "weight heavy",
                                                 "all", "n/a", "14", "n/a"]
    broken = write_run(tmp_path / "broken", {"mixture": {"sources": "everything"}}, [epoch_row(1, [1])])
    assert "config.json's mixture entry is not a list of sources; left out." in parse(
        build_report([broken], grid=False)).text


def test_a_run_on_one_whole_folder_has_no_mixture_part(tmp_path: Path):
    run = write_run(tmp_path / "run", {}, [{k: v for k, v in epoch_row(1, []).items() if k != "mixture_drawn"}])
    assert "Data mixture" not in parse(build_report([run], grid=False)).text


@pytest.mark.slow
def test_a_mixed_run_links_every_source_and_labels_with_the_union_classes(tmp_path: Path):
    from click.testing import CliRunner

    from tests.train.conftest import write_feature_folder
    from train.cli import train_command

    one = write_feature_folder(tmp_path / "one", shard_sizes={"train": [40], "val": [12]}, classes=("ant", "bee"))
    two = write_feature_folder(tmp_path / "two", shard_sizes={"train": [20], "val": [8]}, classes=("bee", "cat"))
    result = CliRunner().invoke(train_command, ["--data", str(one), "--data", str(two), "--class-map", "union",
                                                "--out", str(tmp_path / "run"), "--epochs", "1", "--batch-size", "8",
                                                "--quiet", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    page = build_report(tmp_path / "run", grid=False)
    assert str(one) in page and str(two) in page  # both sources are sections of the report
    assert page.count('class="badge features"') >= 3  # the two feature sections, and their links from the run
    assert ">cat<" in page and ">ant<" in page  # the confusion matrix is labelled with the union of class names
