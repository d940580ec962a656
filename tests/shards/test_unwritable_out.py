"""An output folder that cannot be made or written (a file in the way, a path under /proc, no permission, a read-only
file system) is one line naming it, exit 2, in every command; it was an OSError traceback with exit 1."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from shards.atomic import make_output_folder, on_disk_full, owned_folder, write_json_atomic
from shards.errors import InputError
from tests.helpers import make_shard_dataset, write_image_folder

ROOT = Path(__file__).resolve().parents[2]


def test_a_folder_that_cannot_be_made_is_named_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    cases = {tmp_path / "afile": "is a file, not a folder",
             tmp_path / "afile" / "x": "cannot make the folder (Not a directory)",
             Path("/proc/shardcache-test"): "cannot make the folder (No such file or directory)"}
    for folder, message in cases.items():
        with pytest.raises(InputError) as caught:
            make_output_folder(folder)
        assert str(caught.value) == f"{folder}: {message}"
    with pytest.raises(InputError, match="cannot make the folder"):
        owned_folder(tmp_path / "afile" / "x", ".pack")


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.EROFS])
def test_a_write_the_folder_refuses_is_named_in_one_line(tmp_path, code):
    with pytest.raises(InputError) as caught:
        with on_disk_full(tmp_path, "config.json"):
            raise OSError(code, "refused", str(tmp_path / "config.json.tmp"))
    assert str(caught.value) == f"{tmp_path}: cannot write here (config.json): refused"
    for other in (OSError(errno.EIO, "input/output error", str(tmp_path / "x")),  # anything else passes unchanged
                  OSError(code, "refused", "/elsewhere/source.jpg"),  # a read refused elsewhere is not this folder
                  OSError(code, "refused")):
        with pytest.raises(OSError) as passed:
            with on_disk_full(tmp_path):
                raise other
        assert not isinstance(passed.value, InputError)


def test_a_permission_refused_mid_write_leaves_no_temp_file(tmp_path, monkeypatch):
    def refuse(source, *_args, **_kwargs):  # as os.replace raises it: naming the file
        raise PermissionError(errno.EACCES, "Permission denied", str(source))

    monkeypatch.setattr("shards.atomic.os.replace", refuse)
    with pytest.raises(InputError, match="cannot write here"):
        write_json_atomic(tmp_path / "x.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # three commands in fresh interpreters
def test_every_command_refuses_an_out_it_cannot_make(tmp_path):
    src = write_image_folder(tmp_path / "src", ["a", "b"], 2)
    make_shard_dataset(tmp_path / "ds", shard_sizes={"train": [4], "val": [2]}, size=(16, 16))
    (tmp_path / "afile").write_text("x")
    out = str(tmp_path / "afile" / "out")
    commands = {"preprocess.pack.cli:pack_shards_command": [str(src)],
                "preprocess.features.cli:precompute_features_command": [str(tmp_path / "ds"), "--backbone", "resnet18",
                                                                         "--weights", "none"],
                "train.cli:train_command": [str(tmp_path / "ds"), "--epochs", "1", "--batch-size", "2"]}
    for target, args in commands.items():
        module, name = target.split(":")
        code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from {module} import {name} as c; c()"
        done = subprocess.run([sys.executable, "-c", code, *args, "--out", out, "-q"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, (target, done.stderr[-1500:])
        assert done.stderr.strip() == f"error: {out}: cannot make the folder (Not a directory)", target
