"""Training a head on cached features: it learns, it writes a complete run folder, and it resumes exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.train.conftest import write_feature_folder
from train.run.checkpoint import load_checkpoint
from tests.train.configs import train_config
from train.config import TrainConfig
from train.run.loop import train
from shards.runrecord import read_rows

TIMING_FIELDS = {"samples_per_s", "data_wait_share", "epoch_time_s", "stage_seconds", "stage_seconds_by_rank",
                 "first_batch", "memory"}  # measured, not derived from the data


def config(data: Path, out: Path, **changes) -> TrainConfig:
    options = dict(epochs=3, batch_size=16, quiet=True, device="cpu")
    options.update(changes)
    return train_config(str(data), str(out), **options)


def test_linear_head_learns_separable_features(feature_folder: Path, tmp_path: Path):
    summary = train(config(feature_folder, tmp_path / "run"))
    # Chance is 25%; a wrong label mapping between train and val would sit near 0%.
    assert summary["val_top1"] >= 0.9
    assert summary["best_val_top1"] >= summary["val_top1"]
    assert summary["run_dir"] == str(tmp_path / "run")
    assert 0.0 <= summary["data_wait_share"] <= 1.0


def test_broken_label_mapping_cannot_pass_the_threshold(tmp_path: Path):
    """The threshold above means something: train labels rotated against val labels score far below it."""
    folder = write_feature_folder(tmp_path / "cache", shard_sizes={"train": [70, 45], "val": [40]},
                                  classes=("a", "b", "c", "d"), label_shift={"train": 1})
    summary = train(config(folder, tmp_path / "run"))
    assert summary["val_top1"] < 0.5


def test_run_folder_holds_everything_and_loads_without_pickle(feature_folder: Path, tmp_path: Path):
    run = tmp_path / "run"
    train(config(feature_folder, run, epochs=2))
    assert sorted(p.name for p in run.iterdir()) == sorted(
        ["config.json", "run.json", "metrics.jsonl", "curves.png", "last.pt", "best.pt", "model.pt", "report.html",
         "data-events.jsonl"])
    rows = [row.to_json() for row in read_rows(run / "metrics.jsonl")]
    assert [r["epoch"] for r in rows] == [1, 2]
    for key in ("train_loss", "val_loss", "val_top1", "samples_per_s", "data_wait_share", "val_per_class_accuracy",
                "val_confusion"):
        assert key in rows[0]
    assert sum(map(sum, rows[-1]["val_confusion"])) == rows[-1]["val_samples"] == 61
    assert set(rows[-1]["val_per_class_accuracy"]) == {"ant", "bee", "cat", "dog"}
    assert "val_top5" not in rows[0]  # 4 classes: top-5 would always be 100%
    assert json.loads((run / "config.json").read_text())["optim"]["batch_size"] == 16
    with Image.open(run / "curves.png") as image:
        assert image.format == "PNG" and image.size[0] > image.size[1] > 100
    model = torch.load(run / "model.pt", weights_only=True)
    assert model["classes"] == ["ant", "bee", "cat", "dog"]
    assert model["feature_config"]["features_dim"] == 16 and model["feature_config"]["config"]["backbone"]
    head = torch.nn.Linear(16, 4)
    head.load_state_dict(model["state_dict"])
    last = load_checkpoint(run / "last.pt")
    assert last["train_state"]["epoch"] == 2 and last["loader"] is None
    assert set(last["rng"]) >= {"torch", "numpy", "python"}
    best = torch.load(run / "best.pt", weights_only=True)
    assert best["train_state"]["best_val_top1"] == max(r["val_top1"] for r in rows)


@pytest.mark.slow
def test_top5_and_mlp_head_with_many_classes(tmp_path: Path):
    classes = tuple(f"c{i}" for i in range(8))
    folder = write_feature_folder(tmp_path / "cache", shard_sizes={"train": [64, 64], "val": [40]}, classes=classes,
                                  separation=6.0)
    summary = train(config(folder, tmp_path / "run", head="mlp", hidden_dim=32, optimizer="adamw", lr=0.01,
                           warmup_epochs=1))
    assert summary["val_top5"] >= summary["val_top1"] >= 0.8


def strip_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_FIELDS} for row in rows]


@pytest.mark.slow
def test_killed_mid_epoch_and_resumed_equals_uninterrupted_bitwise(feature_folder: Path, tmp_path: Path):
    # An MLP with dropout, so the restored RNG state matters as much as the weights and the loader position.
    options = dict(head="mlp", hidden_dim=32, dropout=0.3, warmup_epochs=1, checkpoint_every=3, label_smoothing=0.1)
    whole = train(config(feature_folder, tmp_path / "whole", **options))

    interrupted = tmp_path / "interrupted"
    stopped = train(config(feature_folder, interrupted, stop_after_steps=14, **options))
    assert stopped["stopped"] and stopped["steps"] == 14
    assert load_checkpoint(interrupted / "last.pt")["train_state"]["step"] == 12  # steps 13-14 are lost, as in a kill
    resumed = train(config(feature_folder, interrupted, resume=True, **options))

    assert resumed["steps"] == whole["steps"] == 30
    expected = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)["state_dict"]
    actual = torch.load(interrupted / "model.pt", weights_only=True)["state_dict"]
    for name, tensor in expected.items():
        assert torch.equal(tensor, actual[name]), name
    assert strip_timing([row.to_json() for row in read_rows(interrupted / "metrics.jsonl")]) == strip_timing(
        [row.to_json() for row in read_rows(tmp_path / "whole" / "metrics.jsonl")])


@pytest.mark.slow
def test_resume_after_the_last_epoch_changes_nothing(feature_folder: Path, tmp_path: Path):
    run = tmp_path / "run"
    first = train(config(feature_folder, run, epochs=2))
    before = (run / "metrics.jsonl").read_bytes()
    again = train(config(feature_folder, run, epochs=2, resume=True))
    assert again["val_top1"] == first["val_top1"] and again["steps"] == first["steps"]
    assert (run / "metrics.jsonl").read_bytes() == before


@pytest.mark.slow
def test_balanced_sampler_and_class_weighted_loss_train(tmp_path: Path):
    folder = write_feature_folder(tmp_path / "cache", shard_sizes={"train": [60, 40], "val": [40]},
                                  classes=("a", "b"))
    for option in ("balanced_sampler", "class_weighted_loss"):
        summary = train(config(folder, tmp_path / option, **{option: True}))
        assert summary["val_top1"] >= 0.9, option


def test_dry_run_reports_one_batch_and_writes_nothing(feature_folder: Path, tmp_path: Path):
    report = train(config(feature_folder, tmp_path / "run", dry_run=True))
    assert report["batch_shape"] == [16, 16]
    assert report["dtype"] == "float16"
    assert report["min"] < 0 < report["max"]
    assert sum(report["label_counts"].values()) == 16
    assert set(report["label_counts"]) <= {"ant", "bee", "cat", "dog"}
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_windowed_feature_order_trains_and_resumes_exactly(feature_folder: Path, tmp_path: Path):
    """--feature-window: the head trains through the read-ahead loader, and a run stopped mid-epoch and resumed
    ends with the same weights as one that was not."""
    options = dict(feature_window=8, checkpoint_every=3, epochs=2)
    whole = train(config(feature_folder, tmp_path / "whole", **options))
    interrupted = tmp_path / "interrupted"
    train(config(feature_folder, interrupted, stop_after_steps=7, **options))
    resumed = train(config(feature_folder, interrupted, resume=True, **options))
    assert resumed["steps"] == whole["steps"]
    expected = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)["state_dict"]
    actual = torch.load(interrupted / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(tensor, actual[name]) for name, tensor in expected.items())
