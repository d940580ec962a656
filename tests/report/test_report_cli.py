"""``shards report``: where the page goes, the JSON line, and one-line errors with exit 2 for bad paths."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from shards.cli.main import main
from tests.report.page import parse


def _run(*args: str):
    return CliRunner().invoke(main, ["report", *args])


def test_one_folder_gets_its_report_inside_it(dataset_dir: Path):
    result = _run(str(dataset_dir), "--quiet")
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line == {"out": str(dataset_dir / "report.html"),
                    "sections": [{"anchor": "dataset-1", "kind": "dataset", "path": str(dataset_dir)}]}
    assert parse((dataset_dir / "report.html").read_text()).tags.count("img") == 12


def test_several_folders_make_one_page_here(dataset_dir: Path, feature_dir: Path, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = _run(str(dataset_dir), str(feature_dir), "--no-grid", "-q")
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["out"] == "report.html"
    assert [s["kind"] for s in line["sections"]] == ["dataset", "features", "dataset"]
    html = (tmp_path / "report.html").read_text()
    assert "<img" not in html


def test_out_names_the_file(dataset_dir: Path, tmp_path: Path):
    target = tmp_path / "pages" / "data.html"
    result = _run(str(dataset_dir), "--out", str(target), "--no-grid")
    assert result.exit_code == 0, result.output
    assert target.is_file() and "report: " in result.stderr


def test_a_folder_of_no_known_kind_is_a_one_line_error(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("hello")
    result = _run(str(tmp_path))
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "is neither a dataset" in result.stderr
    assert not (tmp_path / "report.html").exists()


def test_missing_and_remote_paths_exit_2(tmp_path: Path, dataset_dir: Path):
    assert _run(str(tmp_path / "nope")).exit_code == 2
    remote = _run("s3://bucket/data")
    assert remote.exit_code == 2 and "local folders only" in remote.stderr
    assert _run(str(dataset_dir), "--out", "s3://bucket/report.html").exit_code == 2


def test_report_has_help():
    result = CliRunner().invoke(main, ["report", "--help"])
    assert result.exit_code == 0 and "--no-grid" in result.output and "--out" in result.output
