"""The verdicts a run records for each epoch (``train.run.diagnose.verdicts``) and the run report opens with: each
rule on numbers, and on a tiny run made to show it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from shards.report.build import build_report
from shards.runrecord import read_rows
from tests.train.conftest import write_feature_folder
from tests.train.configs import train_config
from train.run import diagnose
from train.run.loop import train

CLASSES = ("ant", "bee", "cat", "dog")


def rules(found: list[dict[str, str]]) -> dict[str, str]:
    return {v["rule"]: v["level"] for v in found}


def test_accuracy_at_chance_allows_for_a_small_val_split():
    assert diagnose.accuracy_verdict(0.40, 61, 4)["level"] == "bad"  # 3 standard errors over 61 images: 41.6%
    assert diagnose.accuracy_verdict(0.45, 61, 4)["level"] == "good"
    assert diagnose.accuracy_verdict(0.30, 10_000, 4)["level"] == "good"
    # The most common class is the chance a model that ignores its input gets: 80% of val is one class.
    assert diagnose.accuracy_verdict(0.80, 1000, 2, majority_share=0.8)["level"] == "bad"


def test_one_class_reads_the_predicted_column_of_the_confusion_matrix():
    collapsed = [[0, 10, 0], [0, 12, 0], [0, 9, 1]]
    verdict = diagnose.one_class_verdict(collapsed, ["a", "b", "c"], 0.5)
    assert verdict is not None and "'b' for 31 of 32" in verdict["text"] and "set to 0.5" in verdict["text"]
    assert diagnose.one_class_verdict([[8, 2], [3, 7]], None, None) is None


def test_loss_at_ln_c_and_a_diverged_loss():
    assert diagnose.loss_verdict(math.log(8) * 1.01, math.log(8), 8)["rule"] == "loss_at_chance"
    assert diagnose.loss_verdict(math.log(8), 1.2, 8) is None  # val learnt: not flat
    assert diagnose.loss_verdict(float("nan"), 1.0, 8)["rule"] == "diverged"
    assert diagnose.loss_verdict(float("inf"), None, 0)["rule"] == "diverged"  # regression too
    assert diagnose.loss_verdict(0.3, 0.4, 0) is None


def test_data_verdict_needs_an_epoch_long_enough_to_judge():
    assert diagnose.data_verdict(0.53, 0.010) is None  # 53% of 10 ms concludes nothing
    starving = diagnose.data_verdict(0.75, 20.0)
    assert starving["level"] == "bad" and "15.0 s of the 20.0 s" in starving["text"] and "4.0x" in starving["text"]
    assert diagnose.data_verdict(0.05, 20.0)["level"] == "good"
    assert diagnose.data_verdict(0.5, 3.0)["level"] == "good"  # 1.5 s waited: under the absolute minimum


def test_verdicts_come_worst_first():
    fields = {"val_top1": 0.9, "val_samples": 500, "train_loss": 0.2, "val_loss": 0.3,
              "data_wait_share": 0.6, "epoch_time_s": 30.0}
    found = diagnose.verdicts(fields, 4)
    assert [v["rule"] for v in found] == ["data", "accuracy"] and found[0]["level"] == "bad"
    assert rules(diagnose.verdicts({"val_loss": 0.1, "train_loss": 0.1}, 0)) == {}  # regression: no class rules


def _run(tmp_path: Path, name: str, folder_options: dict, **options) -> list[dict[str, str]]:
    folder = write_feature_folder(tmp_path / name, shard_sizes={"train": [64, 64], "val": [48]}, classes=CLASSES,
                                  **folder_options)
    run = tmp_path / name / "run"
    train(train_config(folder, run, epochs=1, batch_size=16, quiet=True, device="cpu", report=True, **options))
    verdicts = read_rows(run / "metrics.jsonl")[-1].verdicts
    html = build_report([run], grid=False)
    first = verdicts[0]["text"]
    assert first in html and html.index(first) < html.index('class="tiles"')  # the section opens with them
    return verdicts


@pytest.mark.slow
def test_labels_unrelated_to_the_features_are_called_chance(tmp_path: Path):
    found = rules(_run(tmp_path, "shuffled", {"separation": 0.0}))
    assert found["accuracy"] == "bad"


@pytest.mark.slow
def test_a_huge_learning_rate_is_called_one_class(tmp_path: Path):
    found = rules(_run(tmp_path, "huge-lr", {"transform": lambda rows: rows + 20}, lr=1e6))
    assert found["one_class"] == "bad" and found["accuracy"] == "bad"


@pytest.mark.slow
def test_a_tiny_feature_epoch_gets_no_data_verdict(tmp_path: Path):
    found = rules(_run(tmp_path, "healthy", {}))
    assert found == {"accuracy": "good"}  # learnt; an epoch of milliseconds says nothing about the pipeline
