"""A source whose every file is broken fails (exit 1, one line, no ``dataset.json``): it "succeeded" with an empty
dataset before. A class whose every file is broken is kept (its number does not shift) and named in a warning."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from preprocess.pack.packer import PackConfig, pack_manifest
from shards.errors import CorruptDataError
from tests.helpers import write_image_folder

ROOT = Path(__file__).resolve().parents[2]


def broken_class(folder: Path, count: int = 3) -> None:
    folder.mkdir(parents=True)
    for i in range(count):
        (folder / f"{i}.jpg").write_text("not a jpeg")


@pytest.mark.slow  # two runs of the command in a fresh interpreter
def test_a_source_with_no_packable_file_fails_in_one_line_and_writes_no_manifest(tmp_path):
    broken_class(tmp_path / "src" / "a")
    with pytest.raises(CorruptDataError, match=r"no sample could be packed: all 3 source files were skipped "
                                               r"\(the first: a/0.jpg: not an image"):
        pack_manifest(PackConfig(source=str(tmp_path / "src"), out=str(tmp_path / "out"), quiet=True))
    assert not (tmp_path / "out" / "dataset.json").exists()
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from preprocess.pack.cli import pack_shards_command as c;"
            " c()")
    for _ in range(2):  # a rerun ends the same way
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                               "-q"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and done.stdout == ""
        assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == done.stderr.splitlines()
        assert "no sample could be packed" in done.stderr


def test_a_class_whose_every_file_is_broken_is_kept_and_named(tmp_path, caplog):
    src = write_image_folder(tmp_path / "src", ["cat", "dog"], 2)
    broken_class(src / "bird")
    with caplog.at_level("WARNING", logger="shardcache.pack"):
        manifest = pack_manifest(PackConfig(source=str(src), out=str(tmp_path / "out"), quiet=True))
    assert manifest.classes == ("bird", "cat", "dog") and manifest.splits["train"].class_counts == (0, 2, 2)
    [line] = [r.getMessage() for r in caplog.records]  # the skipped files' one line says it
    assert line.endswith("; 1 class(es) got no sample at all: 'bird' (--allow-empty-classes: expected)")
    caplog.clear()
    with caplog.at_level("WARNING", logger="shardcache.pack"):
        pack_manifest(PackConfig(source=str(src), out=str(tmp_path / "out2"), quiet=True, allow_empty_classes=True))
    assert [r.getMessage() for r in caplog.records if "got no sample" in r.getMessage()] == []
