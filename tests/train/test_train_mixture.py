"""``train-from-shards --data PATH[:WEIGHT] ...``: mixtures and subsets from the command line, recorded in the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.train.conftest import write_feature_folder
from train.cli import train_command
from shards.runrecord import read_rows


def run_cli(*args: str):
    return CliRunner().invoke(train_command, [*map(str, args), "--quiet", "--device", "cpu"])


def sources(tmp_path: Path, second_classes=("ant", "bee", "cat")):
    first = write_feature_folder(tmp_path / "one", shard_sizes={"train": [60, 60], "val": [30]},
                                 classes=("ant", "bee", "cat"))
    second = write_feature_folder(tmp_path / "two", shard_sizes={"train": [30], "val": [15]},
                                  classes=second_classes, seed=0)
    return first, second


def test_a_weighted_mixture_trains_and_is_recorded(tmp_path: Path):
    first, second = sources(tmp_path)
    result = run_cli("--data", f"{first}:1", "--data", f"{second}:3", "--out", tmp_path / "run", "--epochs", "2",
                     "--batch-size", "16", "--lr", "0.1")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["val_top1"] > 0.9  # separable classes: the mixture feeds real labels
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    mixture = config["mixture"]
    assert mixture["epoch_size"] == 150 and [s["drawn"] for s in mixture["sources"]] == [38, 112]
    assert [s["available"] for s in mixture["sources"]] == [120, 30]
    assert [s["weight"] for s in config["data"]["sources"]] == [1.0, 3.0]
    rows = [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")]
    assert [row["mixture_drawn"] for row in rows] == [[38, 112], [38, 112]]


def test_different_classes_need_the_union_map(tmp_path: Path):
    first, second = sources(tmp_path, second_classes=("ant", "bee", "dog"))
    refused = run_cli("--data", first, "--data", second, "--out", tmp_path / "run", "--epochs", "1")
    assert refused.exit_code == 2 and "union" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    result = run_cli("--data", first, "--data", second, "--class-map", "union", "--out", tmp_path / "run2",
                     "--epochs", "1", "--batch-size", "16")
    assert result.exit_code == 0, result.output
    model = torch.load(tmp_path / "run2" / "model.pt", weights_only=True)
    assert model["classes"] == ["ant", "bee", "cat", "dog"]
    assert model["train_config"]["data"]["class_map"] == "union" and model["mixture"]["class_map"] == "union"
    assert [s["path"] for s in model["mixture"]["sources"]] == [str(first), str(second)]
    config = json.loads((tmp_path / "run2" / "config.json").read_text())
    assert config["data"]["class_map"] == "union"


def test_a_class_subset_from_the_command_line(tmp_path: Path):
    first, _ = sources(tmp_path)
    result = run_cli(first, "--classes", "ant, cat", "--out", tmp_path / "run", "--epochs", "1", "--batch-size", "8",
                     "--dry-run")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["label_counts"]) == {"ant", "cat"}  # names stripped; both classes in the batch
    assert report["train_batches"] == 80 // 8  # 2 of 3 classes of 120 samples


def test_the_input_kind_comes_from_the_manifest(tmp_path: Path):
    first, _ = sources(tmp_path)
    result = run_cli(first, "--out", tmp_path / "run", "--dry-run", "--batch-size", "8")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["data"] == "features"


@pytest.mark.slow
def test_a_mixture_killed_mid_epoch_resumes_bitwise(tmp_path: Path):
    from tests.train.test_train_features import strip_timing
    from train.run.checkpoint import load_checkpoint
    from tests.train.configs import train_config
    from train.config import TrainConfig
    from train.run.loop import train

    first, second = sources(tmp_path)
    mix = dict(sources=[{"path": str(first), "weight": 1.0}, {"path": str(second), "weight": 2.0}],
               subset={"classes": ["ant", "bee"]}, epochs=2, batch_size=8, quiet=True, device="cpu",
               checkpoint_every=3)

    def config(out: Path, **changes) -> TrainConfig:
        return train_config(str(first), str(out), **mix, **changes)

    whole = train(config(tmp_path / "whole"))
    stopped = train(config(tmp_path / "cut", stop_after_steps=7))
    assert stopped["stopped"] and load_checkpoint(tmp_path / "cut" / "last.pt")["loader"] is not None
    resumed = train(config(tmp_path / "cut", resume=True))
    assert resumed["steps"] == whole["steps"]
    expected = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)["state_dict"]
    actual = torch.load(tmp_path / "cut" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(tensor, actual[name]) for name, tensor in expected.items())
    assert strip_timing([row.to_json() for row in read_rows(tmp_path / "cut" / "metrics.jsonl")]) == strip_timing(
        [row.to_json() for row in read_rows(tmp_path / "whole" / "metrics.jsonl")])
