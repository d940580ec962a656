"""``train-from-shards`` from the command line: one JSON line on success, one-line errors with exit 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from shards.manifest import load_dataset_manifest, load_feature_manifest
from train.cli import train_command


def run_cli(*args: str):
    return CliRunner().invoke(train_command, [*map(str, args), "--quiet", "--device", "cpu"])


def assert_one_line_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert result.stdout == ""


def test_help_lists_the_options():
    result = CliRunner().invoke(train_command, ["--help"])
    assert result.exit_code == 0
    for option in ("--head", "--model", "--weights", "--optimizer", "--warmup-epochs", "--label-smoothing",
                   "--class-weighted-loss", "--balanced-sampler", "--amp", "--checkpoint-every", "--resume",
                   "--dry-run", "--overwrite", "--val-split", "--workers"):
        assert option in result.output


def test_prints_one_json_summary(feature_folder: Path, tmp_path: Path):
    result = run_cli(feature_folder, "--out", tmp_path / "run", "--epochs", "2", "--batch-size", "16")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert summary["val_top1"] >= 0.9
    assert summary["run_dir"] == str(tmp_path / "run")
    assert "data_wait_share" in summary


def test_dry_run_prints_the_batch(feature_folder: Path, tmp_path: Path):
    result = run_cli(feature_folder, "--out", tmp_path / "run", "--batch-size", "8", "--dry-run")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["batch_shape"] == [8, 16] and report["dtype"] == "float16"
    assert not (tmp_path / "run").exists()


def test_stale_features_are_refused(feature_folder: Path, tmp_path: Path):
    dataset_dir = Path(load_feature_manifest(feature_folder).dataset_dir)
    manifest = load_dataset_manifest(dataset_dir)
    manifest.replace(packing={"seed": 1}).save(dataset_dir)  # repacked since the features were computed
    result = run_cli(feature_folder, "--out", tmp_path / "run")
    assert_one_line_error(result, "stale", "features.json")
    assert not (tmp_path / "run").exists()


def test_missing_val_split_is_refused(feature_folder: Path, tmp_path: Path):
    result = run_cli(feature_folder, "--out", tmp_path / "run", "--val-split", "test")
    assert_one_line_error(result, "'test'", "--val-split")


def test_unknown_model_is_refused(image_folder: Path, tmp_path: Path):
    result = run_cli(image_folder, "--out", tmp_path / "run", "--model", "resnet19")
    assert_one_line_error(result, "unknown model 'resnet19'", "resnet18")


def test_data_names_sources_only(image_folder: Path, tmp_path: Path):
    # What a folder holds comes from its manifest; a --data value is always a source, here one that is not there.
    result = run_cli(image_folder, "--out", tmp_path / "run", "--data", "features")
    assert_one_line_error(result, "features")


def test_not_a_shards_folder_is_refused(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    result = run_cli(tmp_path / "empty", "--out", tmp_path / "run")
    assert_one_line_error(result, "neither dataset.json nor features.json")


@pytest.mark.parametrize("args, fragment", [
    (["--epochs", "0"], "epochs=0"),
    (["--label-smoothing", "1.5"], "label_smoothing"),
    (["--balanced-sampler", "--class-weighted-loss"], "choose one"),
    (["--warmup-epochs", "20", "--epochs", "2"], "warmup_epochs"),
])
def test_bad_options_are_refused(feature_folder: Path, tmp_path: Path, args, fragment):
    assert_one_line_error(run_cli(feature_folder, "--out", tmp_path / "run", *args), fragment)


@pytest.mark.slow
def test_run_folder_is_protected(feature_folder: Path, tmp_path: Path):
    run = tmp_path / "run"
    base = [feature_folder, "--out", run, "--epochs", "1", "--batch-size", "16"]
    assert run_cli(*base).exit_code == 0
    assert_one_line_error(run_cli(*base), "--resume")  # the same run again: continue or restart, explicitly
    assert_one_line_error(run_cli(*base, "--lr", "0.5"), "different run", "lr")
    assert run_cli(*base, "--lr", "0.5", "--overwrite").exit_code == 0
    assert json.loads((run / "config.json").read_text())["optim"]["lr"] == 0.5
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert_one_line_error(run_cli(feature_folder, "--out", foreign, "--batch-size", "16"), "no training run")
    assert (foreign / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_the_run_folder_gets_a_report_unless_asked_not_to(feature_folder: Path, tmp_path: Path):
    result = run_cli(feature_folder, "--out", tmp_path / "run", "--epochs", "2", "--batch-size", "16")
    assert result.exit_code == 0, result.output
    page = (tmp_path / "run" / "report.html").read_text()
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert f"{100 * last['val_top1']:.2f}%" in page and "http://" not in page.replace("http://www.w3.org", "")
    quiet = run_cli(feature_folder, "--out", tmp_path / "bare", "--epochs", "1", "--batch-size", "16", "--no-report")
    assert quiet.exit_code == 0 and not (tmp_path / "bare" / "report.html").exists()
    assert (tmp_path / "bare" / "curves.png").exists()
