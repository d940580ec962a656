"""shards inspect on a mixture or a subset: what each epoch holds per source, as JSON on stdout and a table on
stderr; the class counts are exact or marked expected, and a class-list mismatch is one line."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import shards
from shards.check.inspect import drawn_class_counts, mixture_report
from shards.cli.main import main
from shards.select.mixture import MixOptions, Mixture, SourceSpec, Subset
from tests.helpers import make_shard_dataset


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    """Two sources with classes a, b, c (16 and 10 train samples, labels round-robin) and one with a, b, d."""
    out = {"A": tmp_path / "A", "B": tmp_path / "B", "D": tmp_path / "D"}
    make_shard_dataset(out["A"], classes=("a", "b", "c"), shard_sizes={"train": [6, 6, 4], "val": [3]}, size=(8, 8))
    make_shard_dataset(out["B"], classes=("a", "b", "c"), shard_sizes={"train": [5, 5], "val": [3]}, size=(8, 8))
    make_shard_dataset(out["D"], classes=("a", "b", "d"), shard_sizes={"train": [6, 4], "val": [3]}, size=(8, 8))
    return out


def inspect(*args: str, code: int = 0):
    result = CliRunner().invoke(main, ["inspect", *args])
    assert result.exit_code == code, result.output
    return result


def composition(*args: str) -> dict:
    return json.loads(inspect(*args).stdout)


def test_weighted_sources_fill_their_share_of_every_epoch(folders):
    report = composition("--mix", f"{folders['A']}:0.7", "--mix", f"{folders['B']}:0.3", "--epoch-size", "20",
                         "--epochs", "3")
    assert report["epoch_size"] == 20 and report["classes"] == ["a", "b", "c"] and report["class_map"] == "same"
    assert [e["epoch"] for e in report["epochs"]] == [1, 2, 3]
    for epoch in report["epochs"]:
        a, b = epoch["sources"]
        assert a["drawn"] + b["drawn"] == 20
        assert (a["drawn"], b["drawn"]) == (14, 6) and (a["share"], b["share"]) == pytest.approx((0.7, 0.3))
        assert (a["available"], b["available"]) == (16, 10)
        assert (a["passes"], b["passes"]) == pytest.approx((14 / 16, 6 / 10))
        assert a["class_counts"] == {"a": 6, "b": 5, "c": 5} and a["weight"] == 0.7 and a["path"] == str(folders["A"])
        # A fraction of a pass: which shard runs fill it is drawn per epoch, so the counts are expected ones.
        assert a["drawn_class_counts_basis"] == b["drawn_class_counts_basis"] == "expected"
        assert sum(a["drawn_class_counts"].values()) == pytest.approx(14, abs=0.05)
        assert a["drawn_class_counts"]["a"] == pytest.approx(6 * 14 / 16, abs=0.01)


def test_exact_classes_counts_what_each_epoch_draws(folders):
    specs = [SourceSpec(str(folders["A"]), weight=0.7), SourceSpec(str(folders["B"]), weight=0.3)]
    report = composition("--mix", f"{folders['A']}:0.7", "--mix", f"{folders['B']}:0.3", "--epoch-size", "20",
                         "--epochs", "3", "--exact-classes", "--seed", "5")
    dataset = shards.open_dataset(specs, "train", seed=5, mix=MixOptions(epoch_size=20), cache="none",
                                  distributed=shards.Distributed(rank=0, world_size=1))
    for index, epoch in enumerate(report["epochs"]):
        for source in epoch["sources"]:
            assert source["drawn_class_counts_basis"] == "exact"
            assert sum(source["drawn_class_counts"].values()) == source["drawn"]
        dataset.set_epoch(index)
        streamed = collections.Counter(["a", "b", "c"][int(label)] for _, label in dataset)
        reported = collections.Counter()
        for source in epoch["sources"]:
            reported.update(source["drawn_class_counts"])
        assert reported == streamed  # what training would be fed that epoch, class by class


def test_whole_passes_are_exact_without_reading_a_shard(folders):
    args = ("--mix", f"{folders['A']}:repeat=2", "--mix", f"{folders['B']}:choose=10", "--epochs", "2")
    report = composition(*args)
    a, b = report["epochs"][0]["sources"]
    assert (a["drawn"], b["drawn"], report["epoch_size"]) == (32, 10, 42) and (a["passes"], b["passes"]) == (2, 1)
    assert a["drawn_class_counts"] == {"a": 12, "b": 10, "c": 10} and b["drawn_class_counts"] == b["class_counts"]
    assert {s["drawn_class_counts_basis"] for e in report["epochs"] for s in e["sources"]} == {"exact"}
    assert composition(*args, "--exact-classes")["epochs"] == report["epochs"]


def test_a_class_subset_draws_only_that_class(folders):
    one = composition(str(folders["A"]), "--classes", "b", "--epochs", "2")
    for epoch in one["epochs"]:
        (source,) = epoch["sources"]
        assert source["subset"]["classes"] == ["b"] and source["available"] == source["drawn"] == 5
        assert source["class_counts"] == source["drawn_class_counts"] == {"b": 5}
    mixed = composition("--mix", f"{folders['A']}:0.5", "--mix", f"{folders['B']}:0.5", "--classes", "a",
                        "--max-samples", "4")
    for source in mixed["epochs"][0]["sources"]:
        assert source["available"] == 4 and set(source["class_counts"]) == set(source["drawn_class_counts"]) == {"a"}
    filtered = composition(str(folders["A"]), "--where", "class == 'c'")
    assert filtered["epochs"][0]["sources"][0]["drawn_class_counts"] == {"c": 5}


def test_union_class_map_maps_labels_by_name(folders):
    result = inspect("--mix", str(folders["A"]), "--mix", str(folders["D"]), "--class-map", "union",
                     "--exact-classes")
    report = json.loads(result.stdout)
    assert report["classes"] == ["a", "b", "c", "d"] and report["class_map"] == "union"
    a, d = report["epochs"][0]["sources"]
    assert a["drawn_class_counts"] == {"a": 6, "b": 5, "c": 5}
    assert d["drawn_class_counts"] == {"a": 4, "b": 3, "d": 3}  # D's own label 2 is "d", not "c"
    assert "class map union" in result.stderr and "classes drawn (exact)" in result.stderr


def test_different_class_lists_without_union_fail_in_one_line(folders):
    result = inspect("--mix", str(folders["A"]), "--mix", str(folders["D"]), "-q", code=2)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--class-map union" in lines[0]
    assert "Traceback" not in result.output and result.stdout == ""


def test_the_table_on_stderr_says_which_counts_are_expected(folders):
    result = inspect("--mix", f"{folders['A']}:0.7", "--mix", f"{folders['B']}:0.3", "--epoch-size", "20",
                     "--epochs", "2")
    text = result.stderr
    assert "mixture of 2 source(s), split train, class map same, 20 samples per epoch, seed 0" in text
    assert "weight 0.7" in text and "70.0%" in text and "classes drawn (expected)" in text
    assert "epoch 2: the same classes drawn as epoch 1" in text
    assert json.loads(result.stdout)["epoch_size"] == 20


def test_options_that_do_not_fit_together_are_usage_errors(folders):
    assert "describe a mixture" in inspect(str(folders["A"]), "--epochs", "2", code=2).stderr
    assert "give a FOLDER" in inspect(code=2).stderr
    assert "not both" in inspect(str(folders["A"]), "--mix", str(folders["B"]), code=2).stderr
    assert "--batch and --grid" in inspect("--mix", str(folders["A"]), "--batch", code=2).stderr
    assert "is not a weight" in inspect("--mix", f"{folders['A']}:lots", code=2).stderr
    assert json.loads(inspect(str(folders["A"])).stdout)["splits"]["train"]["samples"] == 16  # FOLDER as before


def test_mixture_report_takes_an_opened_dataset_or_the_specs(folders):
    specs = [SourceSpec(str(folders["A"]), weight=1), SourceSpec(str(folders["B"]), weight=1)]
    subset_specs = [SourceSpec(s.path, weight=1, subset=Subset(classes=["a", "c"])) for s in specs]
    dataset = shards.open_dataset(subset_specs, "train", seed=3, cache="none",
                                  distributed=shards.Distributed(rank=0, world_size=1))
    from_dataset = mixture_report(dataset, epochs=2, exact_classes=True)
    assert mixture_report(subset_specs, seed=3, epochs=2, exact_classes=True) == from_dataset
    assert from_dataset["seed"] == 3 and len(from_dataset["epochs"]) == 2


def test_drawn_class_counts_split_the_epoch_by_source():
    """Two sources: rows 0-7 (two runs) and 8-10; a partial draw from the first, two passes of the second."""
    runs = [[np.arange(0, 4), np.arange(4, 8)], [np.arange(8, 11)]]
    specs = (SourceSpec("first", choose=6), SourceSpec("second", repeat=2))
    mixture = Mixture(specs, runs, [6, 6], seed=0, shuffle=True)
    labels = np.array([0, 1, 0, 1, 2, 2, 2, 2, 1, 1, 0])
    for epoch in range(4):
        counts = drawn_class_counts(mixture, epoch, labels, 3)
        rows = mixture.stream(epoch)
        assert counts[0] == np.bincount(labels[rows[rows < 8]], minlength=3).tolist()
        assert counts[1] == [2, 4, 0] and sum(counts[0]) == 6
