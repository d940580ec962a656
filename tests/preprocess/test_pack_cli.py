"""The pack-shards command: exit codes, one-line errors with nothing written, JSON summary, Slurm defaults."""

import json

import pytest
from click.testing import CliRunner

from preprocess.pack.cli import pack_shards_command
from tests.helpers import write_image_folder


def run(args, env=None):
    return CliRunner().invoke(pack_shards_command, [str(a) for a in args], env=env)


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_help_lists_the_options():
    result = run(["--help"])
    assert result.exit_code == 0
    for option in ("--storage", "--shard-samples", "--max-bytes", "--val-fraction", "--verify", "--resize-max-side",
                   "--task-index", "--workers", "--overwrite", "--merge", "--quiet", "--strict"):
        assert option in result.output


def test_summary_is_one_json_line_on_stdout(tmp_path):
    write_image_folder(tmp_path / "src", ["a", "b"], 3, size=(24, 16))
    (tmp_path / "src" / "a" / "zero.png").write_bytes(b"")
    result = run([tmp_path / "src", "--out", tmp_path / "out", "--shard-samples", "4", "--max-bytes", "1M"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    assert (summary["samples"], summary["shards"], summary["skipped"], summary["complete"]) == (6, 2, 1, True)
    manifest = json.loads((tmp_path / "out" / "dataset.json").read_text())
    shards = [s for split in manifest["splits"].values() for s in split["shards"]]
    assert summary["bytes"] == sum(s["bytes"] for s in shards) == sum(
        (tmp_path / "out" / s["path"]).stat().st_size for s in shards)
    assert isinstance(summary["seconds"], float)
    assert "file/s" in result.stderr and "MB/s" in result.stderr


def test_skipped_files_get_one_warning_line_by_reason_even_when_quiet(tmp_path):
    write_image_folder(tmp_path / "src", ["cat", "dog"], 3, size=(24, 16))
    write_image_folder(tmp_path / "src", ["dog"], 5, size=(96, 96))  # img_0000..0004 of dog are now 9,216 pixels
    (tmp_path / "src" / "cat" / "zero.png").write_bytes(b"")
    result = run([tmp_path / "src", "--out", tmp_path / "out", "--max-pixels", "2000", "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["skipped"] == 6
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "WARNING" in lines[0], result.stderr
    assert "skipped 6 of 9 source files: 5 too large, 1 empty file" in lines[0]
    assert "(cat/zero.png, dog/img_0000.jpg, dog/img_0001.jpg, ...)" in lines[0]
    assert "source.skipped" in lines[0]


def test_no_warning_when_nothing_was_left_out(tmp_path):
    write_image_folder(tmp_path / "src", ["a"], 2, size=(16, 16))
    result = run([tmp_path / "src", "--out", tmp_path / "out"])
    assert result.exit_code == 0 and "WARNING" not in result.stderr


def test_quiet_leaves_only_the_summary(tmp_path):
    write_image_folder(tmp_path / "src", ["a"], 2, size=(16, 16))
    result = run([tmp_path / "src", "--out", tmp_path / "out", "--quiet"])
    assert result.exit_code == 0
    assert result.stderr == ""
    assert json.loads(result.stdout)["samples"] == 2


def _empty_class(src):
    write_image_folder(src, ["a"], 2)
    (src / "b").mkdir()
    return src


def _csv(src, text):
    write_image_folder(src / "imgs", ["a"], 1)
    (src / "list.csv").write_text(text)
    return src / "list.csv"


@pytest.mark.parametrize("make_source, message", [
    (lambda src: src / "missing", "missing: no such file or folder"),
    (lambda src: src.mkdir() or src, "holds no class folders"),
    (_empty_class, "class folder holds no images"),
    (lambda src: _csv(src, "path,label,weight\nimgs/a/img_0000.jpg,a,1\n"), "line 1: unknown column 'weight'"),
    (lambda src: _csv(src, "path,label\nimgs/a/nope.jpg,a\n"), "line 2: no such file"),
    (lambda src: _csv(src, "path,label\nimgs/a/img_0000.jpg,\n"), "line 2: empty label"),
], ids=["missing-root", "empty-root", "empty-class", "csv-column", "csv-missing-file", "csv-empty-label"])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, make_source, message):
    source = make_source(tmp_path / "src")
    result = run([source, "--out", tmp_path / "out"])
    assert result.exit_code == 2
    assert len(error_lines(result)) == 1 and message in error_lines(result)[0]
    assert result.stdout == ""
    assert not (tmp_path / "out").exists()


def test_allow_empty_classes_keeps_the_class(tmp_path):
    _empty_class(tmp_path / "src")
    result = run([tmp_path / "src", "--out", tmp_path / "out", "--allow-empty-classes", "-q"])
    assert result.exit_code == 0
    manifest = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert manifest["classes"] == ["a", "b"] and manifest["splits"]["train"]["class_counts"] == [2, 0]


def test_existing_different_dataset_exits_2(tmp_path):
    write_image_folder(tmp_path / "src", ["a"], 3, size=(16, 16))
    assert run([tmp_path / "src", "--out", tmp_path / "out", "-q"]).exit_code == 0
    result = run([tmp_path / "src", "--out", tmp_path / "out", "--seed", "7", "-q"])
    assert result.exit_code == 2 and "--overwrite" in error_lines(result)[0]
    assert run([tmp_path / "src", "--out", tmp_path / "out", "--seed", "7", "--overwrite", "-q"]).exit_code == 0


def test_strict_exits_1_naming_the_file(tmp_path):
    write_image_folder(tmp_path / "src", ["a"], 2, size=(16, 16))
    (tmp_path / "src" / "a" / "cut.jpg").write_bytes(b"\xff\xd8\xff")
    result = run([tmp_path / "src", "--out", tmp_path / "out", "--strict", "-q"])
    assert result.exit_code == 1 and "cut.jpg" in error_lines(result)[0]


def test_slurm_array_variables_pick_the_task_and_merge_finishes(tmp_path):
    write_image_folder(tmp_path / "src", ["a", "b"], 4, size=(16, 16))
    args = [tmp_path / "src", "--out", tmp_path / "out", "--shard-samples", "2", "-q"]
    first = run(args, env={"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"})
    summary = json.loads(first.stdout)
    assert (summary["task_index"], summary["num_tasks"], summary["complete"], summary["shards"]) == (1, 2, False, 2)
    early = run(["--merge", tmp_path / "out", "-q"])
    assert early.exit_code == 1 and "not packed yet" in error_lines(early)[0]
    second = run(args + ["--task-index", "0", "--num-tasks", "2"])
    assert json.loads(second.stdout)["complete"] is True
    merged = run(["--merge", tmp_path / "out", "-q"])
    assert merged.exit_code == 0 and json.loads(merged.stdout)["samples"] == 8


def test_source_and_out_are_required_without_merge(tmp_path):
    result = run(["--quiet"])
    assert result.exit_code == 2 and "--out" in error_lines(result)[0]


def test_the_pack_command_starts_without_importing_torch():
    # pack-shards runs on storage and login nodes; importing torch there costs seconds and gigabytes of pages.
    import subprocess
    import sys

    code = "import sys, preprocess.pack.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
