"""``pack-shards --table``: a CSV's rows become float32 feature shards that open_dataset and train-from-shards read
unchanged, scaled by train-split statistics recorded in features.json, with bad cells refused by row and column."""

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
from shards.formats.features import load_feature_shard
from shards.manifest import load_feature_manifest


def run(*args):
    return CliRunner().invoke(pack_shards_command, [str(a) for a in args])


def pack(csv_path: Path, out: Path, *args) -> dict:
    result = run(csv_path, "--table", "--out", out, "--quiet", *args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def write_csv(path: Path, header, rows) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_sklearn_csv(path: Path, dataset) -> Path:
    """A scikit-learn toy dataset as CSV (written from arrays, so no pandas is needed)."""
    integer = dataset.target.dtype.kind in "iu"
    rows = [[repr(float(v)) for v in x] + [int(y) if integer else repr(float(y))]
            for x, y in zip(dataset.data, dataset.target)]
    return write_csv(path, [*dataset.feature_names, "target"], rows)


def read_split(folder: Path, split: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    rows = list(shards.open_dataset(folder, split, return_keys=True, sampling=shards.Sampling(shuffle=False)))
    return (np.stack([r[0].numpy() for r in rows]), np.array([r[1] for r in rows]), [r[2] for r in rows])


def shard_rows(folder: Path, split: str) -> dict[str, tuple[np.ndarray, int, float | None]]:
    """key -> (features, label, target) over every shard of a split, read straight from the files."""
    manifest = load_feature_manifest(folder)
    out = {}
    for info in manifest.splits[split].shards:
        data = torch.load(folder / info.path, weights_only=True)
        targets = data.get("targets")
        for i, key in enumerate(data["keys"]):
            out[key] = (data["features"][i].numpy(), int(data["labels"][i]),
                        None if targets is None else float(targets[i]))
    return out


def toy_rows(n: int = 40, seed: int = 0) -> list[list]:
    """x1 informative, x2 noise, a label of two classes."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        label = i % 2
        rows.append([f"{rng.normal(3.0 * label, 1.0):.6f}", f"{rng.normal(10.0, 2.0):.6f}", "ab"[label]])
    return rows


@pytest.fixture
def toy_csv(tmp_path: Path) -> Path:
    return write_csv(tmp_path / "toy.csv", ["x1", "x2", "label"], toy_rows())


# -- end to end -------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wine", "breast_cancer"])
def test_linear_head_matches_logistic_regression(tmp_path: Path, name: str):
    from sklearn import datasets
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    from train.cli import train_command

    source = write_sklearn_csv(tmp_path / f"{name}.csv", getattr(datasets, f"load_{name}")())
    summary = pack(source, tmp_path / "feat", "--target", "target")
    assert summary["task"] == "classification"
    result = CliRunner().invoke(train_command, [str(tmp_path / "feat"), "--out", str(tmp_path / "run"), "--head",
                                                "linear", "--epochs", "30", "--batch-size", "16", "--device", "cpu",
                                                "--quiet"])
    assert result.exit_code == 0, result.output
    ours = json.loads(result.stdout.strip().splitlines()[-1])["val_top1"]
    carried = torch.load(tmp_path / "run" / "model.pt", weights_only=True)["feature_config"]["config"]
    assert carried["columns"] == load_feature_manifest(tmp_path / "feat").config["columns"]  # scaling travels along

    # scikit-learn on exactly the same rows, scaled by its own scaler fitted on the train rows of the raw CSV.
    raw = np.loadtxt(source, delimiter=",", skiprows=1)
    def rows_of(split):
        keys = read_split(tmp_path / "feat", split)[2]
        index = [int(k.removeprefix("row-")) - 2 for k in keys]  # spreadsheet row 2 is the first data row
        return raw[index, :-1], raw[index, -1]
    x_train, y_train = rows_of("train")
    x_val, y_val = rows_of("val")
    scaler = StandardScaler().fit(x_train)
    reference = LogisticRegression(max_iter=5000).fit(scaler.transform(x_train), y_train)
    theirs = reference.score(scaler.transform(x_val), y_val)
    assert ours >= theirs - 0.03, (ours, theirs)


def test_train_from_shards_reads_a_table_folder_as_it_is(toy_csv: Path, tmp_path: Path):
    from train.cli import train_command

    pack(toy_csv, tmp_path / "feat", "--target", "label")
    result = CliRunner().invoke(train_command, [str(tmp_path / "feat"), "--out", str(tmp_path / "run"),
                                                "--batch-size", "8", "--device", "cpu", "--dry-run"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["batch_shape"] == [8, 2] and report["dtype"] == "float32"
    assert "freshness" not in result.stderr and "WARNING" not in result.stderr


def test_open_dataset_yields_float32_rows_of_the_recorded_width(tmp_path: Path):
    header = ["x1", "color", "x2", "label"]
    rows = [[str(i), "red" if i % 3 else "blue", str(i * i % 7), str(i % 2)] for i in range(30)]
    pack(write_csv(tmp_path / "t.csv", header, rows), tmp_path / "feat", "--target", "label",
         "--categorical", "color")
    manifest = load_feature_manifest(tmp_path / "feat")
    assert manifest.dtype == "float32" and manifest.features_dim == 4
    assert manifest.config["feature_names"] == ["x1", "color=blue", "color=red", "x2"]
    for split in ("train", "val"):
        for features, label in shards.open_dataset(tmp_path / "feat", split):
            assert features.dtype == torch.float32 and features.shape == (4,)
            assert label in (0, 1)


# -- splits -----------------------------------------------------------------------------------------------------


def test_split_column_assigns_the_rows(tmp_path: Path):
    rows = [[str(i), str(i % 2), ["train", "val", "test"][i % 3]] for i in range(30)]
    summary = pack(write_csv(tmp_path / "t.csv", ["x", "label", "split"], rows), tmp_path / "feat",
                   "--target", "label")
    assert summary["rows"] == {"train": 10, "val": 10, "test": 10}
    assert summary["features"] == 1  # the split column is not an input
    for split, offset in (("train", 0), ("val", 1), ("test", 2)):
        keys = read_split(tmp_path / "feat", split)[2]
        assert sorted(int(k.removeprefix("row-")) - 2 for k in keys) == list(range(offset, 30, 3))
    assert load_feature_manifest(tmp_path / "feat").config["split"]["column"] == "split"


def test_val_fraction_split_is_stratified_and_seeded(tmp_path: Path):
    rows = [[str(i), "abc"[0 if i < 60 else (1 if i < 90 else 2)]] for i in range(100)]
    source = write_csv(tmp_path / "t.csv", ["x", "label"], rows)
    val_keys = {}
    for run_name, seed in (("a", 0), ("b", 0), ("c", 1)):
        summary = pack(source, tmp_path / run_name, "--target", "label", "--val-fraction", "0.2", "--seed", seed)
        assert summary["rows"] == {"train": 80, "val": 20}
        _, labels, keys = read_split(tmp_path / run_name, "val")
        assert np.bincount(labels, minlength=3).tolist() == [12, 6, 2]  # 20% of every class
        assert load_feature_manifest(tmp_path / run_name).splits["val"].class_counts == (12, 6, 2)
        val_keys[run_name] = set(keys)
    assert val_keys["a"] == val_keys["b"] and val_keys["a"] != val_keys["c"]


def test_without_split_column_or_fraction_a_fifth_goes_to_val(toy_csv: Path, tmp_path: Path):
    assert pack(toy_csv, tmp_path / "feat", "--target", "label")["rows"] == {"train": 32, "val": 8}


# -- scaling and the recorded recipe ----------------------------------------------------------------------------


def test_standardisation_uses_train_statistics_only(tmp_path: Path):
    rows = [[f"{i * 0.5:.1f}", "train" if i < 20 else "val", str(i % 2)] for i in range(20)]
    rows += [["1000.0", "val", "0"], ["-500.0", "val", "1"]]  # far-off val rows must not move the statistics
    pack(write_csv(tmp_path / "t.csv", ["x", "split", "label"], rows), tmp_path / "feat", "--target", "label")
    column = load_feature_manifest(tmp_path / "feat").config["columns"][0]
    train_x = np.array([i * 0.5 for i in range(20)])
    assert column["mean"] == pytest.approx(train_x.mean(), abs=1e-12)
    assert column["std"] == pytest.approx(train_x.std(), abs=1e-12)
    train = shard_rows(tmp_path / "feat", "train")
    stored = np.array([train[f"row-{i + 2:06d}"][0][0] for i in range(20)])
    assert stored.mean() == pytest.approx(0.0, abs=1e-6) and stored.std() == pytest.approx(1.0, abs=1e-6)
    val = shard_rows(tmp_path / "feat", "val")
    assert val["row-000022"][0][0] == pytest.approx((1000.0 - train_x.mean()) / train_x.std(), rel=1e-6)


def test_recorded_encoding_scales_new_rows_like_the_packed_ones(tmp_path: Path):
    header = ["x1", "color", "x2", "label"]
    rows = [[str(i), "red" if i % 3 else "blue", "" if i == 5 else str(i * i % 7), str(i % 2)] for i in range(30)]
    source = write_csv(tmp_path / "t.csv", header, rows)
    pack(source, tmp_path / "feat", "--target", "label", "--categorical", "color", "--impute", "mean")
    encoding = TableEncoding.from_config(load_feature_manifest(tmp_path / "feat").config)
    stored = {**shard_rows(tmp_path / "feat", "train"), **shard_rows(tmp_path / "feat", "val")}
    new_rows = [dict(zip(header, row)) for row in rows]
    encoded = encoding.encode_rows(new_rows)
    for i in range(30):
        np.testing.assert_array_equal(encoded[i], stored[f"row-{i + 2:06d}"][0])


# -- bad cells --------------------------------------------------------------------------------------------------


def one_line_error(result) -> str:
    """The command failed with exit 2 and one line (logs aside: only --quiet silences them)."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def test_missing_cell_is_refused_naming_row_and_column(toy_csv: Path, tmp_path: Path):
    rows = toy_rows()
    rows[6][1] = ""  # spreadsheet row 8: the header is row 1
    rows[9][0] = "NA"
    source = write_csv(tmp_path / "dirty.csv", ["x1", "x2", "label"], rows)
    line = one_line_error(run(source, "--table", "--target", "label", "--out", tmp_path / "feat"))
    assert "dirty.csv" in line and "row 8, column 'x2'" in line and "--impute" in line and "2 bad cells" in line
    assert not (tmp_path / "feat").exists()


def test_non_numeric_cell_is_refused_even_with_impute(tmp_path: Path):
    rows = toy_rows()
    rows[3][0] = "12,5 kg"
    source = write_csv(tmp_path / "dirty.csv", ["x1", "x2", "label"], rows)
    line = one_line_error(run(source, "--table", "--target", "label", "--impute", "mean", "--out", tmp_path / "f"))
    assert "row 5, column 'x1'" in line and "'12,5 kg' is not a number" in line and "--categorical" in line
    assert not (tmp_path / "f").exists()


def test_impute_fills_from_the_train_split_and_is_recorded(tmp_path: Path):
    rows = [["1", "train", "0"], ["2", "train", "1"], ["", "train", "0"], ["10", "train", "1"],
            ["", "val", "0"], ["99", "val", "1"]]
    pack(write_csv(tmp_path / "t.csv", ["x", "split", "label"], rows), tmp_path / "feat", "--target", "label",
         "--impute", "median")
    config = load_feature_manifest(tmp_path / "feat").config
    column = config["columns"][0]
    assert config["impute"] == "median" and column["fill"] == 2.0  # median of 1, 2, 10 (train only: not 99)
    filled = np.array([1, 2, 2, 10], dtype=float)
    assert column["mean"] == pytest.approx(filled.mean()) and column["std"] == pytest.approx(filled.std())
    val = shard_rows(tmp_path / "feat", "val")
    assert val["row-000006"][0][0] == pytest.approx((2.0 - filled.mean()) / filled.std(), rel=1e-6)


def test_constant_column_is_dropped_with_a_warning_and_recorded(tmp_path: Path):
    rows = [[str(i), "7", str(i % 2), "train" if i < 16 else "val"] for i in range(20)]
    rows[-1][1] = "8"  # differs only in val: still constant where the statistics come from
    result = run(write_csv(tmp_path / "t.csv", ["x", "flat", "label", "split"], rows), "--table",
                 "--target", "label", "--out", tmp_path / "feat")
    assert result.exit_code == 0, result.output
    assert "column 'flat' dropped" in result.stderr
    assert json.loads(result.stdout)["dropped"] == ["flat"]
    manifest = load_feature_manifest(tmp_path / "feat")
    assert manifest.features_dim == 1 and manifest.config["feature_names"] == ["x"]
    assert manifest.config["dropped"] == [{"column": "flat", "reason": "constant in the train split (7)"}]


# -- categories -------------------------------------------------------------------------------------------------


def categorical_csv(tmp_path: Path) -> Path:
    rows = [[str(i), ["red", "blue", "green"][i % 3], "train", str(i % 2)] for i in range(12)]
    rows += [["3", "green", "val", "0"], ["4", "purple", "val", "1"]]  # purple: never seen in train
    return write_csv(tmp_path / "c.csv", ["x", "color", "split", "label"], rows)


def test_categorical_one_hot_from_train_categories(tmp_path: Path):
    pack(categorical_csv(tmp_path), tmp_path / "feat", "--target", "label", "--categorical", "color")
    config = load_feature_manifest(tmp_path / "feat").config
    assert config["columns"][1] == {"name": "color", "kind": "categorical", "categories": ["blue", "green", "red"]}
    assert config["encode"] == "onehot" and config["unknown_category"] == "all-zero one-hot"
    assert config["feature_names"] == ["x", "color=blue", "color=green", "color=red"]
    val = shard_rows(tmp_path / "feat", "val")
    assert val["row-000014"][0][1:].tolist() == [0.0, 1.0, 0.0]
    assert val["row-000015"][0][1:].tolist() == [0.0, 0.0, 0.0]


def test_categorical_codes(tmp_path: Path):
    pack(categorical_csv(tmp_path), tmp_path / "feat", "--target", "label", "--categorical", "color",
         "--encode", "codes")
    config = load_feature_manifest(tmp_path / "feat").config
    assert config["feature_names"] == ["x", "color"] and config["unknown_category"] == -1
    train = shard_rows(tmp_path / "feat", "train")
    assert [train[f"row-{i + 2:06d}"][0][1] for i in range(3)] == [2.0, 0.0, 1.0]  # red, blue, green
    val = shard_rows(tmp_path / "feat", "val")
    assert val["row-000014"][0][1] == 1.0 and val["row-000015"][0][1] == -1.0


# -- targets ----------------------------------------------------------------------------------------------------


def test_string_target_classes_are_sorted_names(tmp_path: Path):
    rows = [[str(i), ["setosa", "virginica", "versicolor"][i % 3]] for i in range(30)]
    summary = pack(write_csv(tmp_path / "t.csv", ["x", "species"], rows), tmp_path / "feat", "--target", "species")
    assert summary["task"] == "classification"
    assert summary["classes"] == ["setosa", "versicolor", "virginica"]
    features, labels, keys = read_split(tmp_path / "feat", "train")
    names = {f"row-{i + 2:06d}": row[1] for i, row in enumerate(rows)}
    assert all(summary["classes"][label] == names[key] for label, key in zip(labels, keys))


@pytest.mark.slow
def test_regression_targets_and_statistics_are_recorded(tmp_path: Path):
    from sklearn.datasets import load_diabetes

    diabetes = load_diabetes()
    summary = pack(write_sklearn_csv(tmp_path / "d.csv", diabetes), tmp_path / "feat", "--target", "target")
    assert summary["task"] == "regression" and summary["classes"] == []
    manifest = load_feature_manifest(tmp_path / "feat")
    target = manifest.config["target"]
    assert target["task"] == "regression" and target["stored_as"] == "targets"
    train = shard_rows(tmp_path / "feat", "train")
    train_index = [int(k.removeprefix("row-")) - 2 for k in train]
    assert target["mean"] == pytest.approx(diabetes.target[train_index].mean())
    assert target["std"] == pytest.approx(diabetes.target[train_index].std())
    for key, (features, label, value) in train.items():
        assert value == pytest.approx(diabetes.target[int(key.removeprefix("row-")) - 2], rel=1e-6) and label == 0
    stacked = np.stack([features for features, _, _ in train.values()])
    np.testing.assert_allclose(stacked.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(stacked.std(0), 1.0, atol=1e-5)
    means = [c["mean"] for c in manifest.config["columns"]]
    np.testing.assert_allclose(means, diabetes.data[train_index].mean(0), rtol=1e-9, atol=1e-12)


def test_task_option_overrides_the_inference(toy_csv: Path, tmp_path: Path):
    rows = [[str(i), str(i % 3)] for i in range(30)]
    source = write_csv(tmp_path / "t.csv", ["x", "y"], rows)
    assert pack(source, tmp_path / "a", "--target", "y")["task"] == "classification"
    assert pack(source, tmp_path / "b", "--target", "y", "--task", "regression")["task"] == "regression"


# -- output -----------------------------------------------------------------------------------------------------


def test_same_csv_and_seed_give_identical_bytes(toy_csv: Path, tmp_path: Path):
    pack(toy_csv, tmp_path / "a", "--target", "label", "--shard-samples", "10")
    pack(toy_csv, tmp_path / "b", "--target", "label", "--shard-samples", "10")
    names = sorted(p.name for p in (tmp_path / "a").iterdir() if p.suffix == ".pt")
    assert names == ["train-000000.pt", "train-000001.pt", "train-000002.pt", "train-000003.pt", "val-000000.pt"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    manifests = [json.loads((tmp_path / run / "features.json").read_text()) for run in "ab"]
    for manifest in manifests:
        manifest.pop("created")
    assert manifests[0] == manifests[1]
    before = (tmp_path / "a" / "features.json").read_bytes()
    assert pack(toy_csv, tmp_path / "a", "--target", "label", "--shard-samples", "10")["unchanged"] is True
    assert (tmp_path / "a" / "features.json").read_bytes() == before


def test_shards_are_cut_at_max_samples(toy_csv: Path, tmp_path: Path):
    pack(toy_csv, tmp_path / "feat", "--target", "label", "--shard-samples", "10")
    manifest = load_feature_manifest(tmp_path / "feat")
    assert [s.samples for s in manifest.splits["train"].shards] == [10, 10, 10, 2]
    assert len(load_feature_shard(tmp_path / "feat" / "train-000003.pt")) == 2


def test_a_folder_holding_other_output_needs_overwrite(toy_csv: Path, tmp_path: Path):
    pack(toy_csv, tmp_path / "feat", "--target", "label")
    (tmp_path / "feat" / "notes.txt").write_text("mine")
    line = one_line_error(run(toy_csv, "--table", "--target", "label", "--seed", "1", "--out", tmp_path / "feat"))
    assert "holds other features" in line and "--overwrite" in line
    pack(toy_csv, tmp_path / "feat", "--target", "label", "--seed", "1", "--overwrite")
    assert load_feature_manifest(tmp_path / "feat").config["split"]["seed"] == 1
    assert (tmp_path / "feat" / "notes.txt").read_text() == "mine"
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "dataset.json").write_text("{}")
    line = one_line_error(run(toy_csv, "--table", "--target", "label", "--out", tmp_path / "images", "--overwrite"))
    assert "dataset.json" in line


def test_options_of_the_other_kind_of_packing_are_refused(toy_csv: Path, tmp_path: Path):
    line = one_line_error(run(toy_csv, "--table", "--target", "label", "--out", tmp_path / "f", "--workers", "2"))
    assert "--workers applies to image packing" in line
    line = one_line_error(run(toy_csv, "--target", "label", "--out", tmp_path / "f"))
    assert "--target works only with --table" in line
    line = one_line_error(run(toy_csv, "--table", "--target", "nope", "--out", tmp_path / "f"))
    assert "no column 'nope'" in line and "x1, x2, label" in line
    assert not (tmp_path / "f").exists()


def test_hdf5_storage(toy_csv: Path, tmp_path: Path):
    pack(toy_csv, tmp_path / "feat", "--target", "label", "--storage", "hdf5")
    features, labels, _ = read_split(tmp_path / "feat", "train")
    assert features.dtype == np.float32 and features.shape == (32, 2) and set(labels) == {0, 1}


def test_shards_verify_accepts_a_table_folder(toy_csv: Path, tmp_path: Path):
    from shards.check.features_verify import verify_feature_folder

    pack(toy_csv, tmp_path / "out", "--target", "label")
    assert verify_feature_folder(tmp_path / "out", full=True) == []
    shard = sorted((tmp_path / "out").glob("*.pt"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])  # still checked like any feature folder
    assert any(shard.name in problem for problem in verify_feature_folder(tmp_path / "out"))


def test_a_regression_target_constant_in_the_train_split_is_refused(tmp_path: Path):
    # The target's statistics come from train: varying only in val, it still cannot be standardised.
    rows = [[str(i), "2.5" if i < 16 else str(i + 0.5), "train" if i < 16 else "val"] for i in range(20)]
    result = run(write_csv(tmp_path / "t.csv", ["x", "y", "split"], rows), "--table", "--target", "y",
                 "--task", "regression", "--out", tmp_path / "feat")
    assert result.exit_code == 2, result.output
    assert "every train row" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "feat" / "features.json").exists()
