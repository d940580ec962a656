"""Class names and split names are bounded by the scan, in every kind of list, before anything is written: a label of
5,000 characters wrote shards and then stopped at the plan (which reads strings of up to 4,096), and a split of 300
characters stopped at the file system ("File name too long"), both leaving a folder no rerun could recover."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preprocess.pack.packer import PackConfig, pack_manifest
from preprocess.pack.sources.kind import MAX_CLASS_CHARS
from shards.errors import InputError
from tests.helpers import class_image


def image_list(folder: Path, rows: list[tuple[str, str]], kind: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(len(rows)):
        (folder / f"{i}.jpg").write_bytes(class_image(i % 2, i, size=(8, 8)))
    if kind == "csv":
        lines = ["path,label,split"] + [f"{i}.jpg,{label},{split}" for i, (label, split) in enumerate(rows)]
        (folder / "list.csv").write_text("\n".join(lines) + "\n")
        return folder / "list.csv"
    lines = [json.dumps({"path": f"{i}.jpg", "label": label, "split": split}) for i, (label, split) in enumerate(rows)]
    (folder / "list.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "list.jsonl"


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
@pytest.mark.parametrize("rows,message", [
    ([("cat", "train"), ("y" * 5000, "train")], "label (longer than|is a string of).* characters"),
    ([("cat", "train"), ("y" * 300, "train")], f"label longer than {MAX_CLASS_CHARS} characters"),
    ([("cat", "train"), ("dog", "s" * 300)], "is not a plain name: letters, digits, _, at most 64 characters"),
    ([("cat", "train"), ("dog", "my split")], "is not a plain name"),
])
def test_a_label_or_split_out_of_bounds_is_refused_before_anything_is_written(tmp_path, kind, rows, message):
    listed = image_list(tmp_path / "src", rows, kind)
    with pytest.raises(InputError, match=message) as caught:
        pack_manifest(PackConfig(source=str(listed), out=str(tmp_path / "out"), quiet=True))
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400
    assert not (tmp_path / "out").exists()


def test_labels_and_splits_within_bounds_pack(tmp_path):
    listed = image_list(tmp_path / "src", [("c" * MAX_CLASS_CHARS, "train"), ("dog", "t" * 64)], "csv")
    manifest = pack_manifest(PackConfig(source=str(listed), out=str(tmp_path / "out"), quiet=True))
    assert manifest.classes == ("c" * MAX_CLASS_CHARS, "dog") and set(manifest.splits) == {"train", "t" * 64}


def test_a_parquet_label_out_of_bounds_is_refused(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    image = class_image(0, 0, size=(8, 8))
    pq.write_table(pa.table({"image": [image, image], "label": ["z" * 300, "b"]}), tmp_path / "s.parquet")
    with pytest.raises(InputError, match=f"label longer than {MAX_CLASS_CHARS} characters"):
        pack_manifest(PackConfig(source=str(tmp_path / "s.parquet"), out=str(tmp_path / "out"), quiet=True))
    assert not (tmp_path / "out").exists()
