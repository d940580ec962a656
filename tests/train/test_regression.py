"""``train-from-shards --task regression``: a head trained on a table's float target, standardised with the train
split's mean and std, scored by val MSE, MAE and R², and on par with scikit-learn on the same rows."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import shards
from preprocess.pack.cli import pack_shards_command
from preprocess.pack.table.encoding import TableEncoding
from shards.errors import InputError
from shards.manifest import load_feature_manifest
from shards.report.build import write_run_report
from tests.preprocess.test_table import write_csv
from train.cli import train_command
from tests.train.configs import train_config
from train.config import TrainConfig
from train.model.regression import RegressionTally, TargetScale

TRAIN_ARGS = ("--head", "linear", "--task", "regression", "--epochs", "30", "--batch-size", "32", "--device", "cpu",
              "--quiet", "--no-report")


def pack(source: Path, out: Path, *args) -> dict:
    result = CliRunner().invoke(pack_shards_command, [str(source), "--table", "--out", str(out), "--quiet", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def train(folder: Path, out: Path, *args):
    return CliRunner().invoke(train_command, [str(folder), "--out", str(out), *args])


def summary_of(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def split_rows(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Features, targets and keys of a split as the stream yields them (manifest order)."""
    rows = list(shards.open_dataset(folder, split, return_keys=True, sampling=shards.Sampling(shuffle=False)))
    return np.stack([r[0].numpy() for r in rows]), np.array([r[1] for r in rows]), [r[2] for r in rows]


def row_index(keys: list[str]) -> list[int]:
    return [int(key.removeprefix("row-")) - 2 for key in keys]  # spreadsheet row 2 is the first data row


@pytest.fixture(scope="module")
def diabetes(tmp_path_factory) -> dict:
    """scikit-learn's diabetes table as CSV, packed with a 20% val split, and one linear regression run on it."""
    from sklearn.datasets import load_diabetes

    root = tmp_path_factory.mktemp("diabetes")
    data = load_diabetes()
    rows = [[repr(float(v)) for v in x] + [repr(float(y))] for x, y in zip(data.data, data.target)]
    source = write_csv(root / "diabetes.csv", [*data.feature_names, "target"], rows)
    packed = pack(source, root / "feat", "--target", "target", "--val-fraction", "0.2", "--seed", "0")
    assert packed["task"] == "regression"
    summary = summary_of(train(root / "feat", root / "run", *TRAIN_ARGS))
    return {"source": source, "feat": root / "feat", "run": root / "run", "summary": summary,
            "raw": np.loadtxt(source, delimiter=",", skiprows=1)}


def test_linear_head_reaches_linear_regression_r2_on_the_same_split(diabetes):
    from sklearn.linear_model import LinearRegression

    raw = diabetes["raw"]
    train_rows = row_index(split_rows(diabetes["feat"], "train")[2])
    val_rows = row_index(split_rows(diabetes["feat"], "val")[2])
    reference = LinearRegression().fit(raw[train_rows, :-1], raw[train_rows, -1])
    theirs = reference.score(raw[val_rows, :-1], raw[val_rows, -1])
    ours = diabetes["summary"]["val_r2"]
    assert ours >= theirs - 0.03, (ours, theirs)
    assert diabetes["summary"]["task"] == "regression" and "val_top1" not in diabetes["summary"]
    assert {"val_mse", "val_mae"} <= set(diabetes["summary"])


def test_metrics_rows_hold_mse_mae_r2_and_no_top1(diabetes):
    rows = [json.loads(line) for line in (diabetes["run"] / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30
    for row in rows:
        assert {"train_loss", "val_loss", "val_mse", "val_mae", "val_r2"} <= set(row)
        assert not {"val_top1", "train_top1", "val_confusion", "val_per_class_accuracy"} & set(row)
        assert row["val_samples"] == 88 and 0 < row["val_mae"] < row["val_mse"]


def test_summary_scores_are_the_last_epochs_val_metrics(diabetes):
    last = json.loads((diabetes["run"] / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("val_r2", "val_mse", "val_mae"):
        assert diabetes["summary"][key] == pytest.approx(last[key])
    # R² and MSE are two views of the same errors: 1 - SSE / SST over the val targets.
    targets = split_rows(diabetes["feat"], "val")[1]
    assert last["val_r2"] == pytest.approx(1 - last["val_mse"] / targets.var(), rel=1e-6)


def predict(model_pt: dict, features: np.ndarray) -> np.ndarray:
    """What a user of model.pt does: the linear head, then un-scale with the carried mean and std."""
    head = torch.nn.Linear(model_pt["features_dim"], 1)
    head.load_state_dict(model_pt["state_dict"])
    with torch.no_grad():
        outputs = head(torch.from_numpy(features)).squeeze(1).double().numpy()
    return outputs * model_pt["target"]["std"] + model_pt["target"]["mean"]


def test_best_pt_is_the_lowest_val_mse_epoch(diabetes):
    rows = [json.loads(line) for line in (diabetes["run"] / "metrics.jsonl").read_text().splitlines()]
    lowest = min(rows, key=lambda row: row["val_mse"])
    best = torch.load(diabetes["run"] / "best.pt", weights_only=True)
    assert best["train_state"]["epoch"] == lowest["epoch"]
    assert best["train_state"]["best_val_mse"] == pytest.approx(lowest["val_mse"])
    features, targets, _ = split_rows(diabetes["feat"], "val")
    model_pt = torch.load(diabetes["run"] / "model.pt", weights_only=True)
    predicted = predict({**model_pt, "state_dict": best["model"]}, features)
    assert np.mean((predicted - targets) ** 2) == pytest.approx(lowest["val_mse"], rel=1e-4)


def test_model_pt_carries_the_scaling_so_new_rows_predict_as_in_validation(diabetes):
    model_pt = torch.load(diabetes["run"] / "model.pt", weights_only=True)
    config = load_feature_manifest(diabetes["feat"]).config
    assert model_pt["task"] == "regression" and model_pt["classes"] == []
    carried = model_pt["target"]
    assert (carried["mean"], carried["std"], carried["column"]) == (config["target"]["mean"], config["target"]["std"],
                                                                    "target")
    assert model_pt["feature_config"]["config"] == config  # the whole table config: columns, scaling, target
    # New rows: raw cells through the carried encoding, the head, and the carried target scale.
    with open(diabetes["source"], newline="", encoding="utf-8") as handle:
        cells = list(csv.DictReader(handle))
    _, targets, keys = split_rows(diabetes["feat"], "val")
    encoding = TableEncoding.from_config(model_pt["feature_config"]["config"])
    predicted = predict(model_pt, encoding.encode_rows([cells[i] for i in row_index(keys)]))
    r2 = 1 - np.sum((predicted - targets) ** 2) / np.sum((targets - targets.mean()) ** 2)
    assert r2 == pytest.approx(diabetes["summary"]["val_r2"], abs=1e-4)


def test_report_and_curves_show_a_regression_run(diabetes):
    page = write_run_report(diabetes["run"]).read_text(encoding="utf-8")
    assert "val R²" in page and "best val MSE" in page
    assert "Curves unavailable" not in page and "Per-class accuracy" not in page


@pytest.mark.parametrize("flag", ["--class-weighted-loss", "--balanced-sampler"])
def test_class_balancing_is_refused_for_regression(diabetes, tmp_path: Path, flag: str):
    result = train(diabetes["feat"], tmp_path / "run", "--device", "cpu", flag)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"error: {flag} needs classes; a regression target has none"]
    assert not (tmp_path / "run").exists()


def test_task_must_agree_with_the_folder(diabetes, tmp_path: Path):
    result = train(diabetes["feat"], tmp_path / "run", "--device", "cpu", "--task", "classification")
    assert result.exit_code == 2 and "holds a regression target" in result.stderr
    rows = [[str(i), str(i % 2)] for i in range(30)]
    pack(write_csv(tmp_path / "c.csv", ["x", "y"], rows), tmp_path / "classes", "--target", "y")
    result = train(tmp_path / "classes", tmp_path / "run", "--device", "cpu", "--task", "regression")
    assert result.exit_code == 2 and "needs features with a float target" in result.stderr
    result = train(tmp_path / "classes", tmp_path / "run", "--device", "cpu", "--loss", "huber")
    assert result.exit_code == 2 and "applies to regression" in result.stderr


def test_huber_loss_and_mlp_head_train_on_standardised_targets(diabetes, tmp_path: Path):
    summary = summary_of(train(diabetes["feat"], tmp_path / "run", "--head", "mlp", "--hidden-dim", "16",
                               "--loss", "huber", "--epochs", "5", "--batch-size", "32", "--device", "cpu",
                               "--quiet", "--no-report"))
    assert summary["task"] == "regression" and summary["val_r2"] > 0.3
    assert torch.load(tmp_path / "run" / "model.pt", weights_only=True)["target"]["loss"] == "huber"


def test_dry_run_reports_the_target_range(diabetes, tmp_path: Path):
    report = summary_of(train(diabetes["feat"], tmp_path / "run", "--dry-run", "--device", "cpu", "--quiet"))
    assert report["task"] == "regression" and "label_counts" not in report
    low, high = report["target_range"]
    assert 0 < low < high and report["batch_shape"][1] == 10


def test_task_and_loss_are_validated_choices():
    assert train_config("x", "y").model.task == "auto"
    with pytest.raises(InputError, match="task='ranking'"):
        train_config("x", "y", task="ranking")
    with pytest.raises(InputError, match="loss='l1'"):
        train_config("x", "y", loss="l1")


def test_tally_matches_sklearn_metrics_summed_over_batches():
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    generator = torch.Generator().manual_seed(0)
    targets = 100 + 20 * torch.randn(50, generator=generator)
    scale = TargetScale(mean=95.0, std=18.0)
    outputs = scale.standardise(targets) + 0.3 * torch.randn(50, generator=generator)
    tally = RegressionTally(scale)
    for part in (slice(0, 17), slice(17, 50)):  # as two ranks or batches would add them up
        tally.update(outputs[part, None], targets[part], torch.tensor(0.0))
    result = tally.result()
    predicted = scale.unscale(outputs.double()).numpy()
    assert result["val_mse"] == pytest.approx(mean_squared_error(targets.double().numpy(), predicted))
    assert result["val_mae"] == pytest.approx(mean_absolute_error(targets.double().numpy(), predicted))
    assert result["val_r2"] == pytest.approx(r2_score(targets.double().numpy(), predicted))
    assert result["val_samples"] == 50


@pytest.mark.slow
def test_killed_mid_epoch_and_resumed_equals_uninterrupted(diabetes, tmp_path: Path):
    from train.run.loop import train as train_run
    from shards.runrecord import read_rows

    def config(out: Path, **changes) -> TrainConfig:
        return train_config(str(diabetes["feat"]), str(out), task="regression", head="mlp",
                            hidden_dim=16, dropout=0.2, epochs=3, batch_size=32, checkpoint_every=4, quiet=True,
                            device="cpu", report=False, **changes)

    whole = train_run(config(tmp_path / "whole"))
    assert train_run(config(tmp_path / "cut", stop_after_steps=16))["stopped"]  # mid epoch 2 of 11 steps each
    resumed = train_run(config(tmp_path / "cut", resume=True))
    timing = {"samples_per_s", "data_wait_share", "epoch_time_s", "stage_seconds", "stage_seconds_by_rank",
              "first_batch", "memory"}  # measured, not derived from the data
    rows = [[{k: v for k, v in row.items() if k not in timing} for row in [row.to_json() for row in read_rows(run / "metrics.jsonl")]]
            for run in (tmp_path / "whole", tmp_path / "cut")]
    assert rows[0] == rows[1]
    assert resumed["best_val_mse"] == whole["best_val_mse"] == min(row["val_mse"] for row in rows[0])
