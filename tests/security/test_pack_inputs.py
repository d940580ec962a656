"""Hostile or careless source trees and options for pack-shards: FIFOs, broken links, BOMs, URLs as --out.

Whatever the source holds, packing never hangs, never aborts for one bad entry, and says what it skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from preprocess.pack import validate as validate_module
from preprocess.pack.packer import PackConfig, pack_manifest
from preprocess.pack.sources.scan import scan_source
from preprocess.pack.validate import InvalidImage, ValidateOptions, read_and_validate
from shards.errors import InputError
from shards.manifest import load_dataset_manifest
from tests.helpers import class_image, write_image_folder

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60  # a regression must fail the test, not hang CI


def cli(tool: str, *args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a console script in a fresh interpreter (a hang is a TimeoutExpired failure, not a stuck suite)."""
    module, command = {"pack-shards": ("preprocess.pack.cli", "pack_shards_command"),
                       "precompute-features": ("preprocess.features.cli", "precompute_features_command")}[tool]
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from {module} import {command} as c; c()"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=cwd or ROOT)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.fixture
def fifo_tree(tmp_path):
    src = write_image_folder(tmp_path / "src", ["cat", "dog"], 3, size=(24, 16))
    os.mkfifo(src / "cat" / "x.jpg")  # opening it for reading blocks until a writer appears: never
    return src


@pytest.mark.parametrize("options", [[], ["--verify", "header"],
                                     pytest.param(["--workers", "2", "--shard-samples", "2"], marks=pytest.mark.slow)])
@pytest.mark.slow
def test_fifo_named_like_an_image_is_skipped_not_read(fifo_tree, tmp_path, options):
    out = tmp_path / "out"
    result = cli("pack-shards", fifo_tree, "--out", out, "--quiet", *options)
    assert result.returncode == 0, result.stderr
    manifest = load_dataset_manifest(out)
    assert [(s.path, s.reason) for s in manifest.source.skipped] == [("cat/x.jpg", "not a regular file (FIFO)")]
    assert sum(split.samples for split in manifest.splits.values()) == 6
    assert manifest.source.files_seen == 7
    assert not list(out.glob("*.tmp"))


@pytest.mark.slow  # over half a second in the quick loop
def test_fifo_under_strict_fails_before_writing(fifo_tree, tmp_path):
    out = tmp_path / "out"
    result = cli("pack-shards", fifo_tree, "--out", out, "--strict")
    assert result.returncode == 1
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "x.jpg" in lines[0] and "not a regular file" in lines[0]
    assert not out.exists()


def test_file_swapped_for_a_fifo_after_the_scan_is_skipped(tmp_path):
    fifo = tmp_path / "swapped.jpg"
    os.mkfifo(fifo)
    outcome: list[BaseException | object] = []

    def read() -> None:
        try:
            outcome.append(read_and_validate(str(fifo), ValidateOptions()))
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(TIMEOUT_S / 4)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert isinstance(outcome[0], InvalidImage) and "not a regular file (FIFO)" in str(outcome[0])


def test_a_file_that_cannot_be_read_in_time_is_skipped(tmp_path, monkeypatch):
    from preprocess.pack.validate import read_file

    slow = tmp_path / "on-a-hung-mount.jpg"
    slow.write_bytes(class_image(0, 0))
    monkeypatch.setattr(validate_module, "_read_regular", lambda path, limit: time.sleep(5) or b"")
    started = time.monotonic()
    with pytest.raises(InvalidImage, match="within 0.2 s"):
        read_file(str(slow), timeout_s=0.2)
    assert time.monotonic() - started < 2


@pytest.mark.slow  # runs pack-shards in a new Python
def test_dangling_symlink_and_symlink_loop_are_skipped_with_a_reason(tmp_path):
    src = write_image_folder(tmp_path / "src", ["cat", "dog"], 2, size=(24, 16))
    (src / "cat" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (src / "dog" / "a.jpg").symlink_to(src / "dog" / "b.jpg")
    (src / "dog" / "b.jpg").symlink_to(src / "dog" / "a.jpg")
    (src / "dog" / "good-link.jpg").symlink_to(src / "dog" / "img_0000.jpg")  # links to files still count
    result = cli("pack-shards", src, "--out", tmp_path / "out", "--quiet")
    assert result.returncode == 0, result.stderr
    manifest = load_dataset_manifest(tmp_path / "out")
    reasons = {s.path: s.reason for s in manifest.source.skipped}
    assert set(reasons) == {"cat/gone.jpg", "dog/a.jpg", "dog/b.jpg"}
    assert reasons["cat/gone.jpg"].startswith("dangling symbolic link")
    assert reasons["dog/a.jpg"] == reasons["dog/b.jpg"] == "symbolic link loop"
    assert sum(split.samples for split in manifest.splits.values()) == 5


def test_dangling_symlink_in_a_list_file_is_skipped(tmp_path):
    write_image_folder(tmp_path / "imgs", ["a"], 2, size=(24, 16))
    (tmp_path / "imgs" / "broken.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (tmp_path / "list.csv").write_text("path,label\nimgs/a/img_0000.jpg,a\nimgs/a/img_0001.jpg,b\n"
                                       "imgs/broken.jpg,b\n")
    scan = scan_source(tmp_path / "list.csv")
    assert [s.rel_path for s in scan.samples] == ["imgs/a/img_0000.jpg", "imgs/a/img_0001.jpg"]
    assert [s.rel_path for s in scan.skipped] == ["imgs/broken.jpg"]


def test_csv_and_jsonl_saved_with_a_byte_order_mark_are_read(tmp_path):
    write_image_folder(tmp_path / "imgs", ["a", "b"], 1, size=(24, 16))
    rows = [("imgs/a/img_0000.jpg", "cat"), ("imgs/b/img_0000.jpg", "dog")]
    # Excel's "CSV UTF-8" (and Notepad's "UTF-8 with BOM") start the file with EF BB BF.
    (tmp_path / "excel.csv").write_bytes(("path,label\r\n" + "".join(f"{p},{c}\r\n" for p, c in rows))
                                         .encode("utf-8-sig"))
    (tmp_path / "list.jsonl").write_bytes("".join(json.dumps({"path": p, "label": c}) + "\n" for p, c in rows)
                                          .encode("utf-8-sig"))
    for name in ("excel.csv", "list.jsonl"):
        scan = scan_source(tmp_path / name)
        assert scan.classes == ("cat", "dog")
        assert [s.rel_path for s in scan.samples] == [p for p, _ in rows]
    manifest = pack_manifest(PackConfig(str(tmp_path / "excel.csv"), str(tmp_path / "out"), quiet=True))
    assert manifest.splits["train"].samples == 2


@pytest.mark.parametrize("url", ["S3://bucket/x", pytest.param("gs://b/x", marks=pytest.mark.slow),
                                 pytest.param("file:///tmp/x", marks=pytest.mark.slow),
                                 pytest.param("pipe:cat > x", marks=pytest.mark.slow)])
def test_url_as_pack_output_is_refused_with_one_line(tmp_path, url):
    write_image_folder(tmp_path / "src", ["a"], 1, size=(24, 16))
    result = cli("pack-shards", tmp_path / "src", "--out", url, cwd=tmp_path)
    assert result.returncode == 2
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and url in lines[0] and "not supported" in lines[0]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no "s3:" folder, nothing else


def test_url_config_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match="s3://bucket/x"):
        PackConfig(str(tmp_path), "s3://bucket/x")


@pytest.fixture
def no_aws(tmp_path, monkeypatch):
    """No AWS credentials anywhere in the chain; staging (if it ever happened) inside tmp_path."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in {"AWS_CONFIG_FILE": tmp_path / "none", "AWS_SHARED_CREDENTIALS_FILE": tmp_path / "none",
                        "AWS_EC2_METADATA_DISABLED": "true", "SHARDCACHE_STAGE_DIR": tmp_path / "stage"}.items():
        monkeypatch.setenv(name, str(value))


@pytest.mark.slow
def test_s3_output_without_credentials_is_refused_before_any_work(tmp_path, no_aws):
    # s3:// is a supported output (staged locally, then uploaded); without credentials nothing is staged.
    write_image_folder(tmp_path / "src", ["a"], 1, size=(24, 16))
    result = cli("pack-shards", tmp_path / "src", "--out", "s3://bucket/x", cwd=tmp_path)
    assert result.returncode == 2
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "s3://bucket/x" in lines[0] and "credentials" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.mark.slow
def test_url_as_feature_output_is_refused_with_one_line(tmp_path, no_aws):
    result = cli("precompute-features", tmp_path / "data", "--out", "s3://bucket/feat", "--weights", "none",
                 "--backbone", "resnet18", cwd=tmp_path)
    assert result.returncode == 2
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "s3://bucket/feat" in lines[0]
    assert [p.name for p in tmp_path.iterdir()] == []


@pytest.mark.parametrize("name", ["list.csv", "list.jsonl"])
@pytest.mark.slow
def test_a_list_file_that_is_not_utf8_is_one_line_not_a_traceback(tmp_path, name):
    # A list saved as Latin-1 by an old spreadsheet: a careless user, not an attacker, but the same promise.
    write_image_folder(tmp_path / "imgs", ["a"], 1, size=(24, 16))
    text = "path,label\nimgs/a/img_0000.jpg,caf\xe9\n" if name.endswith(".csv") else \
        '{"path": "imgs/a/img_0000.jpg", "label": "caf\xe9"}\n'
    (tmp_path / name).write_bytes(text.encode("latin-1"))
    result = cli("pack-shards", tmp_path / name, "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not UTF-8" in lines[0] and name in lines[0]
    assert not (tmp_path / "out" / "dataset.json").exists()
