"""Inputs of extreme shape: JSON nested 1,000 deep, a filter of 1,000 nested ``not``, table cells of 1e308, a header of
100,000 columns, a FIFO or ``/dev/zero`` where a file is expected, a manifest of several GiB.

Whatever the shape, every command answers with one ``error:`` line naming the file, exit 2 (a manifest, its source
index, a sample's metadata read to select samples, an option, a table), in bounded time and memory:
never a ``RecursionError``, ``MemoryError``, a NaN written to disk, or a hang. ``shards report`` leaves a bad
``metrics.jsonl`` line out and says so, as it does for a malformed one.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from preprocess.pack.cli import pack_shards_command
from shards.door.bounded_read import MAX_FILE_BYTES, MAX_JSON_DEPTH
from shards.cli.main import main as shards_cli
from shards.manifest import DatasetManifest, ShardInfo, SplitInfo
from shards.provenance import SourceInfo
from shards.formats.sample import RawSample
from shards.transport.storage import get_storage, shard_name
from shards.select.where import MAX_WHERE_CHARS
from tests.helpers import class_image, make_shard_dataset, serve_folder, write_image_folder
from tests.train.conftest import write_feature_folder
from train.cli import train_command

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60  # a regression must fail the test, not hang CI
DEEP = 1000  # levels: 2 KB of brackets, past CPython's recursion limit
TOO_DEEP = f"nested deeper than {MAX_JSON_DEPTH} levels"


def deep_json(depth: int = DEEP) -> str:
    return "[" * depth + "]" * depth


def one_line_error(result, exit_code: int, *fragments: str) -> str:
    """The command failed with ``exit_code`` and exactly one ``error:`` line holding every fragment."""
    output = result.stderr if hasattr(result, "stderr") else ""
    assert result.exit_code == exit_code, (result.output, result.exception)
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def cli(*args: object) -> subprocess.CompletedProcess:
    """A console script in a fresh interpreter: a hang is a ``TimeoutExpired`` failure, not a stuck suite."""
    tools = {"shards": ("shards.cli.main", "main"), "train-from-shards": ("train.cli", "train_command"),
             "pack-shards": ("preprocess.pack.cli", "pack_shards_command")}
    module, command = tools[str(args[0])]
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from {module} import {command} as c; c()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args[1:])], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=ROOT)


def subprocess_error(result: subprocess.CompletedProcess, exit_code: int, *fragments: str) -> str:
    assert result.returncode == exit_code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def shards_cli_run(*args: object):
    return CliRunner().invoke(shards_cli, [str(a) for a in args])


def train_dry_run(data: Path, out: Path, *args: object):
    return CliRunner().invoke(train_command, [str(data), "--out", str(out), "--dry-run", "--quiet", "--device", "cpu",
                                              "--batch-size", "2", *map(str, args)])


def nest_in(manifest: Path, value: str) -> Path:
    """Put ``value`` (JSON text) under an extra key of ``manifest``: every other field stays valid."""
    text = manifest.read_text().rstrip()
    assert text.endswith("}")
    manifest.write_text(text[:-1] + f', "deep": {value}}}')
    return manifest


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    make_shard_dataset(folder, shard_sizes={"train": [3, 3], "val": [2]}, size=(16, 16))
    return folder


@pytest.fixture
def features(tmp_path: Path) -> Path:
    return write_feature_folder(tmp_path / "cache", shard_sizes={"train": [6], "val": [4]}, classes=("a", "b"),
                                dim=4)


# -- JSON nested 1,000 deep -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["verify"], ["inspect"], ["inspect", "--classes", "a"], ["report", "--no-grid"]])
def test_deep_dataset_json_is_one_line_for_every_shards_command(dataset: Path, tmp_path: Path, command):
    manifest = nest_in(dataset / "dataset.json", deep_json())
    extra = ["--out", tmp_path / "report.html"] if command[0] == "report" else []
    result = shards_cli_run(*command, dataset, *extra)
    one_line_error(result, 2, str(manifest), TOO_DEEP)
    assert not (tmp_path / "report.html").exists()


def test_deep_dataset_json_stops_training(dataset: Path, tmp_path: Path):
    manifest = nest_in(dataset / "dataset.json", deep_json())
    one_line_error(train_dry_run(dataset, tmp_path / "run"), 2, str(manifest), TOO_DEEP)


def test_deep_dataset_json_stops_precompute(dataset: Path, tmp_path: Path):
    from preprocess.features.cli import precompute_features_command

    manifest = nest_in(dataset / "dataset.json", deep_json())

    result = CliRunner().invoke(precompute_features_command, [str(dataset), "--out", str(tmp_path / "feat"),
                                                              "--weights", "none", "--backbone", "resnet18",
                                                              "--device", "cpu", "--quiet"])
    one_line_error(result, 2, str(manifest), TOO_DEEP)


@pytest.mark.parametrize("command", [["verify"], ["inspect"], ["report", "--no-grid"], ["train"]])
def test_deep_features_json_is_one_line(features: Path, tmp_path: Path, command):
    manifest = nest_in(features / "features.json", deep_json())
    if command == ["train"]:
        result = train_dry_run(features, tmp_path / "run")
    else:
        result = shards_cli_run(*command, features, *(["--out", tmp_path / "r.html"] if "report" in command else []))
    one_line_error(result, 2, str(manifest), TOO_DEEP)


def test_json_nested_just_within_the_limit_is_read(dataset: Path):
    nest_in(dataset / "dataset.json", deep_json(MAX_JSON_DEPTH - 2))  # the manifest object is one more level
    assert shards_cli_run("inspect", dataset, "--quiet").exit_code == 0


def test_the_depth_limit_counts_containers_not_brackets_in_strings():
    from shards.door.bounded_read import JSONError, parse_json

    assert parse_json(deep_json(MAX_JSON_DEPTH)) is not None
    assert parse_json(json.dumps({"name": "[" * 10_000})) == {"name": "[" * 10_000}
    for text in (deep_json(MAX_JSON_DEPTH + 1), '{"a": ' * 100 + "1" + "}" * 100, deep_json(1_000_000)):
        with pytest.raises(JSONError, match=TOO_DEEP):
            parse_json(text)


def test_deep_line_in_a_jsonl_image_list_names_the_line(tmp_path: Path):
    write_image_folder(tmp_path / "img", ["cat", "dog"], 2, size=(16, 16))
    rows = [json.dumps({"path": f"img/{c}/img_{i:04d}.jpg", "label": c}) for c in ("cat", "dog") for i in range(2)]
    listing = tmp_path / "list.jsonl"
    listing.write_text("\n".join([*rows[:2], '{"path": ' + deep_json() + ', "label": "cat"}', *rows[2:]]) + "\n")
    result = CliRunner().invoke(pack_shards_command, [str(listing), "--out", str(tmp_path / "out"), "--quiet"])
    one_line_error(result, 2, str(listing), "line 3", TOO_DEEP)
    assert not (tmp_path / "out").exists()


def packed(tmp_path: Path) -> Path:
    """A real pack: shards with ``<key>.json`` members and a source index whose rows carry their position."""
    write_image_folder(tmp_path / "src", ["cat", "dog"], 3, size=(16, 16))
    out = tmp_path / "packed"
    result = CliRunner().invoke(pack_shards_command, [str(tmp_path / "src"), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def test_deep_source_index_line_is_a_manifest_error(tmp_path: Path):
    out = packed(tmp_path)
    manifest = json.loads((out / "dataset.json").read_text())
    index = out / manifest["source_index"]["path"]
    with open(index, "a") as handle:
        handle.write('{"meta": ' + deep_json() + "}\n")
    manifest["source_index"]["sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    del manifest["columns"]  # packed before the column index: a subset reads the source index
    (out / "dataset.json").write_text(json.dumps(manifest))
    lines = index.read_text().count("\n")
    result = shards_cli_run("inspect", out, "--where", "width > 0", "--quiet")
    one_line_error(result, 2, str(index), f"line {lines}", TOO_DEEP)


def test_deep_sample_metadata_under_where_names_the_shard_and_sample(tmp_path: Path):
    folder = tmp_path / "data"
    folder.mkdir()
    name = shard_name("train", 0, "tar")
    with get_storage("tar").writer(folder / name, classes=("a", "b")) as writer:
        for i, meta in enumerate([b'{"width": 16}', b'{"width": ' + deep_json().encode() + b"}"]):
            writer.write(RawSample(f"s{i}", class_image(i, i, (16, 16)), "jpg", i, meta))
    DatasetManifest(storage="tar", classes=("a", "b"),
                    splits={"train": SplitInfo(2, (1, 1), (ShardInfo(name, 2, writer.bytes, writer.sha256),))},
                    source=SourceInfo(kind="generated", root="", files_seen=2), packing={"seed": 0}).save(folder)
    result = shards_cli_run("inspect", folder, "--where", "width > 0", "--quiet")
    one_line_error(result, 2, name, "[sample s1]", TOO_DEEP)


def run_folder(tmp_path: Path, lines: list[str]) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"data": {"path": str(tmp_path / "gone")},
                                                 "run": {"out_dir": str(run)}, "optim": {"epochs": 2}}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_report_leaves_a_deep_metrics_line_out_and_writes_the_page(tmp_path: Path):
    row = {"epoch": 1, "train_loss": 0.9, "val_loss": 0.8, "val_top1": 0.5}
    run = run_folder(tmp_path, [json.dumps(row), '{"epoch": 2, "x": ' + deep_json() + "}"])
    page = tmp_path / "report.html"
    result = shards_cli_run("report", run, "--out", page, "--quiet")
    assert result.exit_code == 0, result.output
    assert re.search(r"metrics\.jsonl line 2 is not a JSON object \([^)]*\); left out", page.read_text())


def test_report_refuses_a_deep_run_config_in_one_line(tmp_path: Path):
    run = run_folder(tmp_path, [json.dumps({"epoch": 1, "train_loss": 0.9})])
    nest_in(run / "config.json", deep_json())
    result = shards_cli_run("report", run, "--out", tmp_path / "report.html")
    one_line_error(result, 2, str(run / "config.json"), TOO_DEEP)


@pytest.mark.slow  # over half a second in the quick loop
def test_deep_json_over_http_is_refused(dataset: Path):
    import shards
    from shards.errors import ManifestError

    nest_in(dataset / "dataset.json", deep_json(100_000))
    with serve_folder(dataset) as url, pytest.raises(ManifestError, match=TOO_DEEP):
        shards.open_dataset(url)


# -- where= of extreme size -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("nots", [1000, 7000])
def test_deeply_nested_where_is_one_line(dataset: Path, nots: int):
    started = time.monotonic()
    result = shards_cli_run("inspect", dataset, "--where", "not " * nots + "width > 0")
    line = one_line_error(result, 2, "where=")
    assert "nests deeper" in line or "longer than" in line
    assert len(line) < 300  # the expression is shortened, not printed whole
    assert time.monotonic() - started < 10


def test_where_longer_than_the_limit_is_refused_before_parsing(dataset: Path):
    long_list = "key in (" + ", ".join(f"'k{i}'" for i in range(MAX_WHERE_CHARS)) + ")"
    one_line_error(shards_cli_run("inspect", dataset, "--where", long_list), 2, "where=", "longer than")


def test_where_parenthesised_to_the_parsers_limit_is_one_line(dataset: Path):
    result = shards_cli_run("inspect", dataset, "--where", "(" * 300 + "width > 0" + ")" * 300)
    one_line_error(result, 2, "where=")


# -- tables: values whose standardisation overflows ----------------------------------------------------------------
def write_table(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def pack_table(source: Path, out: Path, *args: object):
    return CliRunner().invoke(pack_shards_command, [str(source), "--table", "--out", str(out), "--quiet",
                                                    *map(str, args)])


def test_cells_of_1e308_are_refused_naming_row_and_column(tmp_path: Path):
    rows = [[f"{1e308 if i % 2 else -1e308!r}", i % 2, "train"] for i in range(12)]
    source = write_table(tmp_path / "t.csv", ["big", "y", "split"], rows)
    line = one_line_error(pack_table(source, tmp_path / "out", "--target", "y"), 2, str(source), "column 'big'",
                          "too large")
    assert "row " in line
    assert not (tmp_path / "out").exists()


def test_cells_of_1e200_square_past_float64_and_are_refused(tmp_path: Path):
    rows = [[f"{(i + 1) * 1e200!r}", i % 2, "train"] for i in range(12)]
    source = write_table(tmp_path / "t.csv", ["x", "y", "split"], rows)
    one_line_error(pack_table(source, tmp_path / "out", "--target", "y"), 2, "column 'x'", "too large")


def test_an_imputed_mean_that_overflows_names_a_cell_that_is_there(tmp_path: Path):
    rows = [["1e308", i % 2, "train"] for i in range(6)] + [["", 0, "train"]]
    source = write_table(tmp_path / "t.csv", ["x", "y", "split"], rows)
    one_line_error(pack_table(source, tmp_path / "out", "--target", "y", "--impute", "mean"), 2,
                   "row 2, column 'x': 1e+308 is too large")


def test_a_val_cell_too_far_from_the_train_scale_is_refused(tmp_path: Path):
    rows = [[i * 0.1, i % 2, "train"] for i in range(10)] + [[0.5, 0, "val"], ["1e300", 1, "val"]]
    source = write_table(tmp_path / "t.csv", ["x", "y", "split"], rows)
    one_line_error(pack_table(source, tmp_path / "out", "--target", "y"), 2, "row 13, column 'x'", "float32")


def test_a_float_target_with_one_inf_is_not_a_classification(tmp_path: Path):
    rows = [[i, f"{i * 1.37:.2f}"] for i in range(59)] + [[59, "inf"]]
    source = write_table(tmp_path / "t.csv", ["x", "y"], rows)
    one_line_error(pack_table(source, tmp_path / "out", "--target", "y"), 2, str(source), "row 61, column 'y'",
                   "'inf' is not a finite number")
    assert not (tmp_path / "out").exists()


def test_a_regression_target_beyond_float32_is_refused(tmp_path: Path):
    rows = [[i, f"{i * 1.37:.2f}"] for i in range(30)] + [[30, "1e39"]]
    source = write_table(tmp_path / "t.csv", ["x", "y"], rows)
    one_line_error(pack_table(source, tmp_path / "out", "--target", "y", "--task", "regression"), 2,
                   "row 32, column 'y'", "float32")


def test_a_long_cell_that_is_no_number_is_refused_in_linear_time(tmp_path: Path):
    rows = [[i, i % 2] for i in range(10)] + [["1" * 100_000 + "x", 1]]
    source = write_table(tmp_path / "t.csv", ["x", "y"], rows)
    started = time.monotonic()
    one_line_error(pack_table(source, tmp_path / "out", "--target", "y"), 2, "row 12, column 'x'", "not a number")
    assert time.monotonic() - started < 10


def test_a_100000_column_header_fails_fast(tmp_path: Path):
    header = [f"c{i}" for i in range(100_000)] + ["c0"]
    source = write_table(tmp_path / "wide.csv", header, [list(range(len(header)))])
    started = time.monotonic()
    one_line_error(pack_table(source, tmp_path / "out", "--target", "c1"), 2, str(source),
                   "column 'c0' appears twice")
    assert time.monotonic() - started < 10  # quadratic: minutes


# -- files that are not regular, or too large ----------------------------------------------------------------------
def read_keys(path: Path) -> subprocess.CompletedProcess:
    """``Subset(keys=path).key_set()`` in a fresh interpreter: a hang or a runaway read fails by the timeout."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from shards.select.mixture import Subset; "
            f"print(len(Subset(keys={str(path)!r}).key_set()))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("kind", ["FIFO", "character device"])
def test_a_keys_file_that_is_no_regular_file_is_refused_unopened(tmp_path: Path, kind: str):
    path = Path("/dev/zero") if kind == "character device" else tmp_path / "keys"
    if kind == "FIFO":
        os.mkfifo(path)  # opening it for reading would block until a writer appears: never
    result = read_keys(path)
    assert result.returncode == 1 and f"InputError: {path}: not a regular file ({kind})" in result.stderr


@pytest.mark.slow  # starts train-from-shards in a fresh interpreter (torch's import)
@pytest.mark.parametrize("kind", ["FIFO", "character device"])
def test_train_keys_that_are_a_fifo_or_dev_zero_fail_in_one_line(features: Path, tmp_path: Path, kind: str):
    path = Path("/dev/zero") if kind == "character device" else tmp_path / "keys"
    if kind == "FIFO":
        os.mkfifo(path)
    result = cli("train-from-shards", features, "--out", tmp_path / "run", "--keys", path, "--dry-run", "--quiet",
                 "--device", "cpu")
    subprocess_error(result, 2, str(path), f"not a regular file ({kind})")
    assert not (tmp_path / "run").exists()


def test_keys_file_over_the_size_cap_is_refused_unread(features: Path, tmp_path: Path):
    keys = tmp_path / "keys.txt"
    with open(keys, "wb") as handle:
        handle.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk used, and nothing is read
    one_line_error(train_dry_run(features, tmp_path / "run", "--keys", keys), 2, str(keys), "larger than")


def test_keys_file_that_is_not_utf8_is_one_line(features: Path, tmp_path: Path):
    keys = tmp_path / "keys.txt"
    keys.write_bytes(b"train_00001\n\xff\xfe\n")
    one_line_error(train_dry_run(features, tmp_path / "run", "--keys", keys), 2, str(keys), "not UTF-8")


@pytest.mark.parametrize("name", ["list.csv", "list.jsonl"])
@pytest.mark.slow
def test_an_image_list_that_is_a_fifo_fails_without_hanging(tmp_path: Path, name: str):
    listing = tmp_path / name
    os.mkfifo(listing)
    result = cli("pack-shards", listing, "--out", tmp_path / "out", "--quiet")
    subprocess_error(result, 2, str(listing), "not a regular file (FIFO)")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_manifest_that_is_a_fifo_fails_without_hanging(dataset: Path):
    manifest = dataset / "dataset.json"
    manifest.unlink()
    os.mkfifo(manifest)
    for command in (["verify"], ["inspect"]):
        subprocess_error(cli("shards", *command, dataset), 2, str(manifest), "not a regular file (FIFO)")


def fifo_source_dataset(features: Path) -> Path:
    """The feature folder's source ``dataset.json`` (read for its sha256 and shards) swapped for a FIFO."""
    manifest = features.parent / "dataset" / "dataset.json"
    manifest.unlink()
    os.mkfifo(manifest)
    return manifest


@pytest.mark.slow
def test_verify_of_features_whose_source_manifest_is_a_fifo_does_not_hang(features: Path):
    manifest = fifo_source_dataset(features)
    result = cli("shards", "verify", features)
    assert result.returncode == 1 and f"{manifest}: not a regular file (FIFO)" in result.stderr, result.stderr


@pytest.mark.slow  # starts train-from-shards in a fresh interpreter (torch's import)
def test_training_on_features_whose_source_manifest_is_a_fifo_fails_in_one_line(features: Path, tmp_path: Path):
    manifest = fifo_source_dataset(features)
    result = cli("train-from-shards", features, "--out", tmp_path / "run", "--dry-run", "--quiet", "--device", "cpu")
    subprocess_error(result, 2, str(manifest), "not a regular file (FIFO)")


def test_a_huge_manifest_is_refused_unread(dataset: Path, tmp_path: Path):
    manifest = dataset / "dataset.json"
    with open(manifest, "ab") as handle:
        handle.truncate(MAX_FILE_BYTES + 1)
    one_line_error(shards_cli_run("verify", dataset), 2, str(manifest), "larger than")
    one_line_error(train_dry_run(dataset, tmp_path / "run"), 2, str(manifest), "larger than")
