"""The column index format (``shards.formats.columns``): round trip of every dtype, and refusal of every file that
disagrees with its manifest (checksum, size, header), read from a local folder, over http, by two processes."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shards.cache.node import ShardCache
from shards.errors import CorruptDataError, ManifestError, ShardcacheError
from shards.formats.column_writer import manifest_order, write_split_columns
from shards.formats.columns import COLUMNS_KEY
from shards.select.columns import open_columns, verify_columns
from tests.helpers import serve_folder

ROOT = Path(__file__).resolve().parents[2]


def _rows(n: int = 7) -> list[dict]:
    rows = []
    for i in range(n):
        meta = {"path": f"c{i % 2}/é{i}.jpg", "class": "ignored", "width": 10 + i, "height": 5, "ratio": i / 4,
                "mixed": i if i % 2 else i + 0.5, "gray": i % 3 == 0, "list": [i], "none": None,
                "str_num": "x" if i % 2 else 3, "bool_int": True if i % 2 else 1, "key": "not mine", "label": 99}
        if i % 3:
            meta["sometimes"] = f"s{'y' * i}"
        rows.append({"key": f"key-{i:03d}", "label": i % 2, "split": "train", "shard": "train-000000.tar", "row": i,
                     "meta": meta})
    return rows


def _write(folder: Path, rows: list[dict], split: str = "train") -> SimpleNamespace:
    """Columns of ``rows`` under ``folder`` and a manifest stand-in naming them (what ``merge_parts`` records)."""
    entry = write_split_columns(folder, split, lambda: iter(rows), len(rows))
    (folder / "dataset.json").write_text(json.dumps({COLUMNS_KEY: {"format": "npy-1", "splits": {split: entry}}}))
    return _manifest(folder, split, len(rows))


def _manifest(folder: Path, split: str = "train", samples: int | None = None) -> SimpleNamespace:
    extra = json.loads((folder / "dataset.json").read_text())
    if samples is None:
        samples = extra[COLUMNS_KEY]["splits"][split]["rows"]
    return SimpleNamespace(extra=extra, splits={split: SimpleNamespace(samples=samples)}, FILE="dataset.json")


def _spec(manifest, name: str) -> dict:
    return manifest.extra[COLUMNS_KEY]["splits"]["train"]["fields"][name]


def _rerecord(folder: Path, name: str) -> SimpleNamespace:
    """Record the current size and sha256 of field ``name``'s file: only the header checks can catch it then."""
    import hashlib

    manifest = _manifest(folder)
    spec = _spec(manifest, name)
    data = (folder / spec["path"]).read_bytes()
    spec.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (folder / "dataset.json").write_text(json.dumps(manifest.extra))
    return _manifest(folder)


def test_values_a_column_cannot_hold_exactly_leave_their_field_unindexed(tmp_path):
    """NumPy ``S`` drops trailing NULs, a lone surrogate has no UTF-8 form, and a float64 rounds ints past 2**53:
    each such field is read row by row instead of being compared wrong; a big int alone keeps an int64 column."""
    rows = _rows(4)
    for i, row in enumerate(rows):
        row["meta"] = {"nul": "a\x00" if i == 1 else "a", "surrogate": "\ud800" if i == 2 else "b",
                       "big_mixed": (1 << 60) + 1 if i == 0 else 0.5, "big": (1 << 60) + i, "fine": i / 2}
    columns = open_columns(tmp_path, _write(tmp_path, rows), "train")
    assert set(columns.unindexed) == {"nul", "surrogate", "big_mixed"}
    assert columns.column("big").tolist() == [(1 << 60) + i for i in range(4)]
    assert columns.column("fine").tolist() == [0.0, 0.5, 1.0, 1.5]


@pytest.mark.parametrize("key", ["k\x00", "\udcff"])
def test_a_key_a_column_cannot_hold_is_a_manifest_error(tmp_path, key):
    rows = _rows(2)
    rows[1]["key"] = key
    with pytest.raises(ManifestError, match="NUL or is not UTF-8"):
        _write(tmp_path, rows)


def test_every_dtype_round_trips_with_presence_masks_and_unindexed_fields(tmp_path):
    rows = _rows()
    manifest = _write(tmp_path, rows)
    columns = open_columns(tmp_path, manifest, "train")
    assert columns.rows == 7
    assert columns.fields == ("key", "label", "gray", "height", "mixed", "path", "ratio", "sometimes", "width")
    assert columns.unindexed == ("bool_int", "list", "none", "str_num")
    expected = {"key": ("|S7", [r["key"].encode() for r in rows]), "label": ("<i4", [r["label"] for r in rows]),
                "gray": ("|b1", [r["meta"]["gray"] for r in rows]), "height": ("<i8", [5] * 7),
                "mixed": ("<f8", [r["meta"]["mixed"] for r in rows]),
                "path": (f"|S{max(len(r['meta']['path'].encode()) for r in rows)}",
                         [r["meta"]["path"].encode() for r in rows]),
                "ratio": ("<f8", [r["meta"]["ratio"] for r in rows]), "width": ("<i8", [10 + i for i in range(7)])}
    for name, (dtype, values) in expected.items():
        array = columns.column(name)
        assert array.dtype.str == dtype and array.tolist() == values and not array.flags.writeable
        assert columns.present(name) is None
    assert columns.present("sometimes").tolist() == [i % 3 != 0 for i in range(7)]
    assert [v.decode() for v, p in zip(columns.column("sometimes"), columns.present("sometimes")) if p] == \
        [r["meta"]["sometimes"] for r in rows if "sometimes" in r["meta"]]
    with pytest.raises(KeyError):
        columns.column("list")
    names = sorted(p.name for p in (tmp_path / "columns" / "train").iterdir())
    assert names == [f"c{i:03d}.npy" for i in range(10)]  # 9 columns and one mask; no field name on disk
    assert np.load(tmp_path / "columns" / "train" / "c000.npy", allow_pickle=False).tolist() == expected["key"][1]
    copy = pickle.loads(pickle.dumps(columns))  # into a DataLoader worker: maps (and checks) again there
    assert copy.column("width").tolist() == expected["width"][1]


def test_more_rows_than_a_chunk_and_an_empty_split(tmp_path, monkeypatch):
    import shards.formats.column_writer as columns_module

    monkeypatch.setattr(columns_module, "CHUNK_ROWS", 3)
    rows = _rows(11)
    columns = open_columns(tmp_path, _write(tmp_path, rows), "train")
    assert columns.column("width").tolist() == [10 + i for i in range(11)]
    empty = tmp_path / "empty"
    columns = open_columns(empty, _write(empty, []), "train")
    assert columns.rows == 0 and columns.fields == ("key", "label") and columns.column("key").shape == (0,)


def test_a_row_count_other_than_expected_is_refused(tmp_path):
    with pytest.raises(ShardcacheError, match="3 rows for split 'train'.*counts 4"):
        write_split_columns(tmp_path, "train", lambda: iter(_rows(3)), 4)
    assert not (tmp_path / "columns" / "train").exists() or not list((tmp_path / "columns" / "train").iterdir())


def test_rows_out_of_manifest_order_are_refused():
    shards = [SimpleNamespace(path="train-000000.tar", samples=2), SimpleNamespace(path="train-000001.tar", samples=1)]
    rows = [{"split": "train", "shard": "train-000000.tar", "row": 0}, {"split": "val", "shard": "v", "row": 0},
            {"split": "train", "shard": None, "skipped": "bad"},
            {"split": "train", "shard": "train-000000.tar", "row": 1},
            {"split": "train", "shard": "train-000001.tar", "row": 0}]
    assert len(list(manifest_order(rows, "train", shards))) == 3
    swapped = [rows[3], rows[0], rows[4]]
    with pytest.raises(ShardcacheError, match="not in manifest order"):
        list(manifest_order(swapped, "train", shards))
    with pytest.raises(ShardcacheError, match="not in manifest order"):
        list(manifest_order([rows[4]], "train", shards))


def test_a_changed_byte_is_a_checksum_error_naming_the_file(tmp_path):
    manifest = _write(tmp_path, _rows())
    path = tmp_path / _spec(manifest, "width")["path"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    columns = open_columns(tmp_path, manifest, "train")
    with pytest.raises(CorruptDataError, match=r"c\d{3}\.npy: sha256 does not match"):
        columns.column("width")
    assert columns.column("height").tolist() == [5] * 7  # the other files are fine
    assert [p.split(":")[0] for p in verify_columns(tmp_path, manifest)] == [_spec(manifest, "width")["path"]]


@pytest.mark.parametrize("change", ["truncate", "extend"])
def test_a_truncated_or_extended_file_is_refused_before_it_is_read(tmp_path, change):
    manifest = _write(tmp_path, _rows())
    path = tmp_path / _spec(manifest, "ratio")["path"]
    data = path.read_bytes()
    path.write_bytes(data[:-8] if change == "truncate" else data + b"\0" * 8)
    with pytest.raises(CorruptDataError, match=r"c\d{3}\.npy: \d+ bytes, the manifest records"):
        open_columns(tmp_path, manifest, "train").column("ratio")
    # A manifest that records the changed size and checksum still cannot make the reader pass the file's end.
    manifest = _rerecord(tmp_path, "ratio")
    with pytest.raises(CorruptDataError, match=r"a \(7,\) <f8 column is"):
        open_columns(tmp_path, manifest, "train").column("ratio")


def _npy(path: Path, array: np.ndarray, **options) -> None:
    with open(path, "wb") as handle:
        np.lib.format.write_array(handle, array, **options)


@pytest.mark.parametrize("bad, match", [
    ("object", "dtype |O, the manifest records <i8"),
    ("length", r"shape \(6,\), expected \(7,\)"),
    ("fortran", "Fortran order"),
    ("magic", "not a readable .npy column"),
    ("version", "format version"),
    ("dtype", "dtype <f8, the manifest records <i8"),
])
def test_a_file_whose_header_disagrees_is_refused(tmp_path, bad, match):
    manifest = _write(tmp_path, _rows())
    path = tmp_path / _spec(manifest, "width")["path"]
    if bad == "object":
        _npy(path, np.array([1, "x", None, 2, 3, 4, 5], dtype=object), allow_pickle=True)
    elif bad == "length":
        _npy(path, np.arange(6, dtype="<i8"))
    elif bad == "fortran":
        with open(path, "wb") as handle:
            np.lib.format.write_array_header_1_0(handle, {"descr": "<i8", "fortran_order": True, "shape": (7,)})
            handle.write(np.arange(7, dtype="<i8").tobytes())
    elif bad == "magic":
        path.write_bytes(b"\x93NUMPX" + path.read_bytes()[6:])
    elif bad == "version":
        _npy(path, np.arange(7, dtype="<i8"), version=(2, 0))
    else:
        _npy(path, np.arange(7, dtype="<f8"))
    manifest = _rerecord(tmp_path, "width")
    with pytest.raises(CorruptDataError, match=match):
        open_columns(tmp_path, manifest, "train").column("width")


def test_a_manifest_naming_an_object_dtype_or_a_path_outside_the_folder_is_refused(tmp_path):
    folder = tmp_path / "ds"
    manifest = _write(folder, _rows())
    _spec(manifest, "width")["dtype"] = "|O"
    with pytest.raises(ManifestError, match="unsupported column 'width'"):
        open_columns(folder, manifest, "train")
    manifest = _manifest(folder)
    _spec(manifest, "width")["path"] = "../outside.npy"
    with pytest.raises(ManifestError, match="column file path '../outside.npy'"):
        open_columns(folder, manifest, "train").column("width")
    manifest = _manifest(folder)
    target = folder / _spec(manifest, "width")["path"]
    os.replace(target, tmp_path / "moved.npy")
    target.symlink_to(tmp_path / "moved.npy")
    with pytest.raises(ManifestError, match="outside the dataset folder"):
        open_columns(folder, manifest, "train").column("width")
    assert any("outside the dataset folder" in p for p in verify_columns(folder, manifest))
    with pytest.raises(ManifestError, match="7 rows, the split has 8 samples"):
        open_columns(folder, _manifest(folder, samples=8), "train")
    manifest.extra[COLUMNS_KEY]["format"] = "npy-9"
    with pytest.raises(ManifestError, match="unknown columns format"):
        open_columns(folder, manifest, "train")
    assert open_columns(folder, SimpleNamespace(extra={}, splits={}), "train") is None  # packed before columns


_READER = """
import json, sys
from types import SimpleNamespace
from shards.select.columns import open_columns
folder = sys.argv[1]
extra = json.load(open(folder + "/dataset.json"))
rows = extra["columns"]["splits"]["train"]["rows"]
manifest = SimpleNamespace(extra=extra, splits={"train": SimpleNamespace(samples=rows)})
columns = open_columns(folder, manifest, "train")
print(json.dumps([columns.column("width").tolist(), [k.decode() for k in columns.column("key")]]))
"""


def test_two_processes_map_the_same_files(tmp_path):
    rows = _rows()
    _write(tmp_path, rows)
    procs = [subprocess.Popen([sys.executable, "-c", _READER, str(tmp_path)], stdout=subprocess.PIPE, cwd=ROOT)
             for _ in range(2)]
    outputs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1] == [[10 + i for i in range(7)], [r["key"] for r in rows]]


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.slow
def test_a_remote_dataset_is_fetched_once_and_checked(tmp_path, cached):
    folder = tmp_path / "ds"
    rows = _rows()
    manifest = _write(folder, rows)
    cache = ShardCache(dir=tmp_path / "cache") if cached else None
    with serve_folder(folder) as url:
        columns = open_columns(url, manifest, "train", cache=cache)
        assert columns.column("width").tolist() == [10 + i for i in range(7)]
        assert columns.present("sometimes").tolist() == [i % 3 != 0 for i in range(7)]
        if cached:
            assert len(list((tmp_path / "cache").rglob("*.npy"))) == 2
        path = folder / _spec(manifest, "height")["path"]
        path.write_bytes(path.read_bytes()[:-1] + b"\1")
        with pytest.raises(CorruptDataError, match="sha256"):
            open_columns(url, manifest, "train", cache=cache).column("height")
        assert len(verify_columns(url, manifest)) == 1
