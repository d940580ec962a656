"""Hardening round 3 (issue 33), the column index: its ``.npy`` files are opened through the one door, and
``shards verify`` holds the index to the shards.

- A FIFO, socket, directory, symlink loop or a link to ``/dev/zero`` in place of a column file is one error line
  naming the file, never a hang (run in a fresh interpreter with a timeout); a sparse 3 GiB file in its place is
  refused by its size, never read.
- A ``.npy`` header NumPy cannot parse is one error naming the file, whatever NumPy's parser raises.
- A column edited by hand whose size and sha256 in ``dataset.json`` were fixed up to match passes every check of
  the file itself; ``shards verify`` still names it, because it compares each column it can recompute (keys,
  labels) with the samples it reads from the shards anyway.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from shards.check.verify import verify_dataset
from shards.cli.main import main as shards_cli
from shards.errors import CorruptDataError
from shards.formats.columns import COLUMNS_KEY
from shards.select.columns import open_columns, verify_columns
from shards.manifest import load_dataset_manifest
from tests.security.test_tar_round3 import GIB, KINDS, make_special, pack_images, run_bounded


def column_spec(folder: Path, field: str, split: str = "train") -> dict:
    document = json.loads((folder / "dataset.json").read_text())
    return document[COLUMNS_KEY]["splits"][split]["fields"][field]


def edit_column(folder: Path, field: str, edit) -> str:
    """Change field ``field``'s column with ``edit(values)`` (in place), then record the file's new size and
    sha256 in ``dataset.json``, as a careful forger would: only a comparison with the shards can tell. Returns
    the column file's path."""
    path = folder / column_spec(folder, field)["path"]
    values = np.load(path)
    edit(values)
    np.save(path, values)
    data = path.read_bytes()
    document = json.loads((folder / "dataset.json").read_text())
    document[COLUMNS_KEY]["splits"]["train"]["fields"][field].update(
        bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "dataset.json").write_text(json.dumps(document))
    return column_spec(folder, field)["path"]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.slow
def test_a_special_file_in_place_of_a_column_is_one_error_naming_it(tmp_path, kind):
    folder = pack_images(tmp_path)
    name = column_spec(folder, "label")["path"]
    make_special(folder / name, kind)
    out = run_bounded("""
import sys
from shards.errors import ShardcacheError
from shards.select.columns import open_columns, verify_columns
from shards.manifest import load_dataset_manifest
manifest = load_dataset_manifest(sys.argv[1])
try:
    open_columns(sys.argv[1], manifest, "train").column("label")
except ShardcacheError as exc:
    print(f"{type(exc).__name__}: {exc}")
for line in verify_columns(sys.argv[1], manifest):
    print(line)
""", folder)
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    expected = "outside the dataset folder" if kind == "dev-zero" else KINDS[kind]
    assert lines[0].startswith(("CorruptDataError: ", "ManifestError: ")) and name in lines[0], out
    assert lines[1].startswith((name, str(folder))) and all(expected in line for line in lines), out


@pytest.mark.slow  # over half a second in the quick loop
def test_a_sparse_3_gib_file_in_place_of_a_column_is_refused_by_its_size(tmp_path):
    folder = pack_images(tmp_path)
    name = column_spec(folder, "label")["path"]
    with open(folder / name, "r+b") as handle:
        handle.truncate(3 * GIB)
    out = run_bounded("""
import resource, sys
from shards.check.verify import verify_dataset
for line in verify_dataset(sys.argv[1], quiet=True).problems:
    print(line)
print("peak", next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))  # KiB; ru_maxrss survives exec
""", folder)
    *problems, peak = out.strip().splitlines()
    assert len(problems) == 1 and problems[0].startswith(f"{name}: 3221225472 bytes, the manifest records"), out
    assert int(peak.split()[1]) < 1 << 20, out  # KiB: well under the 3 GiB a read would take


def test_verify_names_a_label_column_edited_by_hand_with_its_checksum_fixed(tmp_path):
    folder = pack_images(tmp_path)
    assert verify_dataset(folder, quiet=True).problems == ()

    def relabel(labels: np.ndarray) -> None:
        labels[5] = (labels[5] + 1) % 3

    name = edit_column(folder, "label", relabel)
    key = np.load(folder / column_spec(folder, "key")["path"])[5].decode()
    problems = verify_dataset(folder, quiet=True).problems
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{name}: row 5 (sample {key}): label ") and "train-000001.tar" in problems[0]
    result = CliRunner().invoke(shards_cli, ["verify", str(folder), "--quiet", "--workers", "1"])
    assert result.exit_code == 1 and f"error: {name}: row 5" in result.output


def test_verify_names_a_key_column_whose_rows_were_swapped(tmp_path):
    folder = pack_images(tmp_path)

    def swap(keys: np.ndarray) -> None:
        keys[[0, 9]] = keys[[9, 0]]

    name = edit_column(folder, "key", swap)
    problems = verify_dataset(folder, quiet=True, workers=2).problems
    assert [p.split(" (sample")[0] for p in problems] == [f"{name}: row 0", f"{name}: row 9"], problems
    assert all("key " in p for p in problems)


@pytest.mark.parametrize("header", [
    b"{'descr': '<i8', 'fortran_order': False, 'shape': (4",  # unclosed: the tokenizer's own error
    b"{'descr': '<i8', 'fortran_order': False, 'shape': (4,)} ) ]",
    b"{'descr': '<i8', 'fortran_order': False, 'shape': (4,), 'x': lambda: 1}",
])
def test_a_column_header_numpy_cannot_parse_is_one_error_naming_the_file(tmp_path, header):
    """NumPy parses a ``.npy`` header's dict with Python's tokenizer and ``ast.literal_eval``, which raise errors
    of their own on a damaged one (``tokenize.TokenError`` is not a ``ValueError``) and can take hundreds of MB on
    a nested one; the reader matches the header NumPy writes instead, so each is a ``CorruptDataError`` naming the
    file. (Found by the fuzz suite's ``npy_column`` target.)"""
    folder = pack_images(tmp_path)
    name = column_spec(folder, "label")["path"]
    padded = header + b"        \n"
    (folder / name).write_bytes(b"\x93NUMPY\x01\x00" + len(padded).to_bytes(2, "little") + padded + bytes(48))
    data = (folder / name).read_bytes()
    document = json.loads((folder / "dataset.json").read_text())
    document[COLUMNS_KEY]["splits"]["train"]["fields"]["label"].update(
        bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "dataset.json").write_text(json.dumps(document))
    manifest = load_dataset_manifest(folder)
    with pytest.raises(CorruptDataError, match=rf"{name}: not a readable \.npy column"):
        open_columns(folder, manifest, "train").column("label")
    assert [p.split(" (")[0] for p in verify_columns(folder, manifest)] == [f"{name}: not a readable .npy column"]
