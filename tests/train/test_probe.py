"""``--head logreg`` and ``--standardize``: the probe the field computes, checked against scikit-learn itself.

The features are generated to need what the probe does: 4 overlapping classes (not linearly separable) and
dimensions on scales from 0.01 to 100 with offsets, stored as float32, so standardising matters and a probe that
stopped early or penalised differently would score differently from scikit-learn.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import shards
from shards.formats.features import load_feature_shard
from shards.manifest import load_feature_manifest
from shards.stream.options import Sampling
from tests.train.conftest import write_feature_folder
from tests.train.test_cli import assert_one_line_error
from train.cli import train_command
from train.model.probe import fit_logreg, heldout_split
from train.model.standardize import feature_scale

CLASSES = ("ant", "bee", "cat", "dog")


def distort(rows: torch.Tensor) -> torch.Tensor:
    """Per-dimension scales from 0.01 to 100 and offsets up to 50: raw features a probe must standardise."""
    dim = rows.shape[1]
    scales = torch.logspace(-2, 2, dim)
    offsets = torch.linspace(-50, 50, dim)
    return rows * scales + offsets


@pytest.fixture(scope="module")
def overlapping(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("probe")
    return write_feature_folder(root, shard_sizes={"train": [200, 150, 150, 100], "val": [200, 200]},
                                classes=CLASSES, dim=16, seed=3, separation=1.5, dtype=torch.float32,
                                transform=distort)


def split_arrays(features_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """A split's features (float64, as stored) and labels in manifest order, read without the training code."""
    manifest = load_feature_manifest(features_dir)
    shards_ = [load_feature_shard(features_dir / s.path, mmap=False) for s in manifest.splits[split].shards]
    return (np.concatenate([s.features.double().numpy() for s in shards_]),
            np.concatenate([s.labels.numpy() for s in shards_]))


def sklearn_probe(features_dir: Path, **options):
    """scikit-learn's reference: StandardScaler fitted on train, LogisticRegression(max_iter=1000)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    train_x, train_y = split_arrays(features_dir, "train")
    val_x, val_y = split_arrays(features_dir, "val")
    scaler = StandardScaler().fit(train_x)
    model = LogisticRegression(max_iter=1000, **options).fit(scaler.transform(train_x), train_y)
    return scaler, model, model.score(scaler.transform(val_x), val_y)


def run_cli(*args):
    return CliRunner().invoke(train_command, [*map(str, args), "--quiet", "--device", "cpu"])


def summary_of(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])




def test_feature_scale_is_the_standard_scalers_over_all_shards(overlapping):
    train_x, _ = split_arrays(overlapping, "train")
    dataset = shards.open_dataset(overlapping, "train", sampling=Sampling(shuffle=False))
    scale = feature_scale(dataset)
    assert scale.samples == 600 and scale.mean.dtype == torch.float64
    np.testing.assert_allclose(scale.mean.numpy(), train_x.mean(axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(scale.std.numpy(), train_x.std(axis=0), rtol=1e-12)


def test_the_scale_covers_the_rows_a_subset_or_exclusion_trains_on(overlapping):
    from shards.select.mixture import SourceSpec, Subset

    train_x, train_y = split_arrays(overlapping, "train")
    subset = shards.open_dataset(SourceSpec(str(overlapping), subset=Subset(classes=("bee", "dog"))), "train")
    chosen = np.isin(train_y, [CLASSES.index("bee"), CLASSES.index("dog")])
    scale = feature_scale(subset)
    assert scale.samples == int(chosen.sum())
    np.testing.assert_allclose(scale.mean.numpy(), train_x[chosen].mean(axis=0), rtol=1e-12, atol=1e-12)
    plain = shards.open_dataset(overlapping, "train")
    plain.exclude_rows(np.arange(0, 600, 3))
    kept = np.ones(600, dtype=bool)
    kept[::3] = False
    np.testing.assert_allclose(feature_scale(plain).std.numpy(), train_x[kept].std(axis=0), rtol=1e-12)


def test_a_constant_dimension_keeps_its_scale_and_a_non_finite_one_is_refused(tmp_path):
    from shards.errors import InputError

    def constant_first(rows):
        rows[:, 0] = 7.0
        return rows

    folder = write_feature_folder(tmp_path / "c", shard_sizes={"train": [20, 10], "val": [10]}, classes=CLASSES,
                                  dim=4, dtype=torch.float32, transform=constant_first)
    scale = feature_scale(shards.open_dataset(folder, "train"))
    assert float(scale.mean[0]) == 7.0 and float(scale.std[0]) == 1.0  # StandardScaler's rule: divide by 1

    def overflowing(rows):
        rows[3, 2] = float("inf")
        return rows

    broken = write_feature_folder(tmp_path / "b", shard_sizes={"train": [20], "val": [10]}, classes=CLASSES, dim=4,
                                  dtype=torch.float32, transform=overflowing)
    with pytest.raises(InputError, match="not finite \\(dimension 2\\)"):
        feature_scale(shards.open_dataset(broken, "train"))


@pytest.mark.parametrize("num_classes", [2, 4])
@pytest.mark.parametrize("c", [0.01, 1.0, 100.0])
def test_fit_lands_on_sklearns_coefficients_for_the_same_c(num_classes, c):
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(num_classes)
    labels = rng.integers(0, num_classes, 300)
    features = rng.normal(size=(num_classes, 8))[labels] * 0.7 + rng.normal(size=(300, 8))
    reference = LogisticRegression(C=c, max_iter=1000, tol=1e-10).fit(features, labels)
    fit = fit_logreg(torch.from_numpy(features), torch.from_numpy(labels), num_classes, c)
    assert fit.converged
    weight, bias = fit.weight.numpy(), fit.bias.numpy()
    if num_classes == 2:  # scikit-learn's one vector is the difference of the softmax's two rows
        weight, bias = weight[1:] - weight[:1], bias[1:] - bias[:1]
    else:  # the softmax ignores a common shift of the intercepts: compare them centred
        bias, reference_bias = bias - bias.mean(), reference.intercept_ - reference.intercept_.mean()
        np.testing.assert_allclose(bias, reference_bias, atol=1e-4)
    scale = np.abs(reference.coef_).max()
    np.testing.assert_allclose(weight, reference.coef_, atol=1e-4 * scale)
    if num_classes == 2:
        np.testing.assert_allclose(bias, reference.intercept_, atol=1e-4 * scale)


def test_a_class_without_train_rows_is_never_predicted_and_the_rest_is_sklearns():
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(7)
    labels = rng.choice([0, 2, 4], 240)
    features = rng.normal(size=(5, 6))[labels] + rng.normal(size=(240, 6))
    fit = fit_logreg(torch.from_numpy(features), torch.from_numpy(labels), 5, 1.0)
    reference = LogisticRegression(max_iter=1000, tol=1e-10).fit(features, labels)
    np.testing.assert_allclose(fit.weight[[0, 2, 4]].numpy(), reference.coef_, atol=1e-4)
    assert fit.weight[[1, 3]].abs().sum() == 0
    assert set(fit.logits(torch.from_numpy(rng.normal(size=(500, 6)) * 5)).argmax(dim=1).tolist()) <= {0, 2, 4}


def test_the_held_out_part_is_stratified_seeded_and_leaves_every_class_a_row():
    labels = np.array([0] * 50 + [1] * 10 + [2] * 1)
    fit, held = heldout_split(labels, 0.2, seed=5)
    assert sorted(np.concatenate([fit, held]).tolist()) == list(range(61))
    assert np.bincount(labels[held], minlength=3).tolist() == [10, 2, 0]
    assert np.array_equal(heldout_split(labels, 0.2, seed=5)[1], held)
    assert not np.array_equal(heldout_split(labels, 0.2, seed=6)[1], held)


def test_logreg_run_scores_within_a_point_of_sklearn(overlapping, tmp_path):
    scaler, _, reference = sklearn_probe(overlapping)
    summary = summary_of(run_cli(overlapping, "--out", tmp_path / "run", "--head", "logreg"))
    assert abs(summary["val_top1"] - reference) <= 0.01, (summary["val_top1"], reference)
    assert summary["steps"] > 0 and summary["best_val_top1"] == summary["val_top1"]
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["probe"]["chosen"] == "heldout" and rows[0]["probe"]["converged"]
    assert rows[0]["probe"]["heldout_samples"] == 120 and rows[0]["probe"]["train_samples"] == 600
    # The run records the scaler's numbers, and model.pt applies them: raw val features in, the same top-1 out.
    recorded = json.loads((run / "feature-scale.json").read_text())
    np.testing.assert_allclose(recorded["mean"], scaler.mean_, rtol=1e-12)
    np.testing.assert_allclose(recorded["std"], scaler.scale_, rtol=1e-12)
    model = torch.load(run / "model.pt", weights_only=True)
    state = model["state_dict"]
    np.testing.assert_allclose(state["scale.std"].numpy(), scaler.scale_, rtol=1e-6)
    val_x, val_y = split_arrays(overlapping, "val")
    logits = ((torch.from_numpy(val_x).float() - state["scale.mean"]) / state["scale.std"]) @ state["head.weight"].T \
        + state["head.bias"]
    assert float((logits.argmax(dim=1).numpy() == val_y).mean()) == pytest.approx(summary["val_top1"])
    assert (run / "report.html").is_file() and (run / "best.pt").is_file()
    again = summary_of(run_cli(overlapping, "--out", run, "--head", "logreg", "--resume"))
    assert again["val_top1"] == summary["val_top1"]  # a finished probe is reported, not refitted


def test_a_given_c_is_sklearns_model(overlapping, tmp_path):
    scaler, reference, reference_top1 = sklearn_probe(overlapping, C=0.5, tol=1e-10)
    summary = summary_of(run_cli(overlapping, "--out", tmp_path / "run", "--head", "logreg", "--logreg-c", "0.5"))
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)["state_dict"]
    scale = np.abs(reference.coef_).max()
    np.testing.assert_allclose(state["head.weight"].double().numpy(), reference.coef_, atol=1e-3 * scale)
    assert summary["val_top1"] == pytest.approx(reference_top1, abs=1 / 400)


@pytest.mark.slow
def test_standardize_is_opt_in_for_the_sgd_heads(overlapping, tmp_path):
    plain = summary_of(run_cli(overlapping, "--out", tmp_path / "plain", "--epochs", "1", "--batch-size", "64"))
    assert plain["val_top1"] is not None and not (tmp_path / "plain" / "feature-scale.json").exists()
    assert set(torch.load(tmp_path / "plain" / "model.pt", weights_only=True)["state_dict"]) == {"weight", "bias"}
    run_cli(overlapping, "--out", tmp_path / "std", "--epochs", "1", "--batch-size", "64", "--standardize")
    state = torch.load(tmp_path / "std" / "last.pt", weights_only=True)["model"]
    recorded = json.loads((tmp_path / "std" / "feature-scale.json").read_text())
    assert state["scale.mean"].tolist() == pytest.approx(recorded["mean"])
    assert json.loads((tmp_path / "std" / "config.json").read_text())["model"]["standardize"] is True


def test_what_the_probe_cannot_do_is_one_line_and_exit_2(overlapping, image_folder, tmp_path):
    assert_one_line_error(run_cli(overlapping, "--out", tmp_path / "a", "--head", "logreg", "--memory-limit", "64K"),
                          "--head logreg", "need about", "over the budget of 64.0 KiB")
    assert_one_line_error(run_cli(image_folder, "--out", tmp_path / "b", "--head", "logreg"),
                          "applies to cached features")
    assert_one_line_error(run_cli(overlapping, "--out", tmp_path / "c", "--head", "logreg", "--balanced-sampler"),
                          "balanced_sampler does not apply")
    assert_one_line_error(run_cli(overlapping, "--out", tmp_path / "d", "--logreg-c", "1"), "give head='logreg'")
    assert not any((tmp_path / name).exists() for name in "abcd")

    def overflowing(rows):
        rows[5, 1] = float("inf")
        return rows

    broken = write_feature_folder(tmp_path / "inf", shard_sizes={"train": [40], "val": [10]}, classes=CLASSES,
                                  dim=4, dtype=torch.float32, transform=overflowing)
    assert_one_line_error(run_cli(broken, "--out", tmp_path / "e", "--head", "logreg"), "not finite (dimension 1)")
    assert not (tmp_path / "e").exists()
    assert_one_line_error(run_cli(broken, "--out", tmp_path / "f", "--head", "logreg", "--no-standardize"),
                          "not finite")


@pytest.mark.slow
def test_under_torchrun_every_rank_scores_rank_0s_fit(feature_folder, tmp_path):
    from tests.train.test_ddp import torchrun

    ddp = torchrun(feature_folder, tmp_path / "ddp", "--head", "logreg", "--logreg-c", "1")
    single = summary_of(run_cli(feature_folder, "--out", tmp_path / "single", "--head", "logreg", "--logreg-c", "1"))
    assert ddp["world_size"] == 2 and ddp["steps"] == single["steps"]
    weights = [torch.load(tmp_path / run / "model.pt", weights_only=True)["state_dict"]["head.weight"]
               for run in ("ddp", "single")]
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-4, atol=1e-5)
    assert abs(ddp["val_top1"] - single["val_top1"]) <= 1 / 61  # val padded to 2 x 31 rows: one repeated
