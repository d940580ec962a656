"""Scanning sources: which files count, how classes and splits are found, keys, and input errors."""

import json
import re

import pytest

from preprocess.pack.sources.columns import sample_key
from preprocess.pack.sources.scan import scan_source
from shards.errors import InputError, MissingInputError
from tests.helpers import class_image, write_image_folder
from tests.preprocess.corpus import write_mixed_tree

SAFE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def test_image_folder_classes_files_and_keys(tmp_path):
    made = write_mixed_tree(tmp_path)
    scan = scan_source(tmp_path)
    assert scan.kind == "imagefolder"
    assert scan.classes == ("animals", "plants")
    assert {s.rel_path for s in scan.samples} == set(made)  # hidden and .txt ignored, nested kept, .JPG kept
    assert [s.rel_path for s in scan.samples] == sorted(made)
    labels = {s.rel_path: s.label for s in scan.samples}
    assert labels["plants/nested/deeper/leaf.png"] == 1 and labels["animals/exif_rotated.JPG"] == 0
    keys = [s.key for s in scan.samples]
    assert len(set(keys)) == len(keys)  # animals/img_0000.jpg and plants/img_0000.jpg differ
    assert all(SAFE_KEY.match(k) for k in keys)
    unicode = next(s for s in scan.samples if "café" in s.rel_path)
    assert SAFE_KEY.match(unicode.key) and unicode.size == (tmp_path / unicode.rel_path).stat().st_size


def test_keys_are_stable_and_depend_only_on_the_relative_path():
    assert sample_key("cat/a.jpg") == sample_key("cat/a.jpg")
    assert sample_key("cat/a.jpg") != sample_key("dog/a.jpg")
    assert sample_key("cat/a.jpg") != sample_key("cat/a.JPG")
    long_key = sample_key("x" * 300 + "/y.jpg")
    assert len(long_key) < 90 and "." not in long_key


def test_train_val_test_trees_are_kept_as_splits(tmp_path):
    write_image_folder(tmp_path / "train", ["a", "b"], 3)
    write_image_folder(tmp_path / "val", ["a", "b"], 2)
    write_image_folder(tmp_path / "test", ["b", "c"], 1)
    scan = scan_source(tmp_path)
    assert scan.kind == "imagefolder-splits"
    assert scan.classes == ("a", "b", "c")
    counts = {split: sum(s.split == split for s in scan.samples) for split in ("train", "val", "test")}
    assert counts == {"train": 6, "val": 4, "test": 2}


def test_csv_and_jsonl_lists(tmp_path):
    write_image_folder(tmp_path / "imgs", ["a", "b"], 2)
    absolute = tmp_path / "imgs" / "b" / "img_0001.jpg"
    (tmp_path / "list.csv").write_text(
        f"path,label,split\nimgs/a/img_0000.jpg,cat,train\nimgs/a/img_0001.jpg,dog,val\n{absolute},cat,train\n")
    scan = scan_source(tmp_path / "list.csv")
    assert scan.kind == "csv" and scan.classes == ("cat", "dog")
    assert [(s.rel_path, s.label, s.split) for s in scan.samples] == [
        ("imgs/a/img_0000.jpg", 0, "train"), ("imgs/a/img_0001.jpg", 1, "val"), ("imgs/b/img_0001.jpg", 0, "train")]
    rows = [{"path": "imgs/a/img_0000.jpg", "label": 3}, {"path": "imgs/b/img_0000.jpg", "label": 1}]
    (tmp_path / "list.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    scan = scan_source(tmp_path / "list.jsonl")
    assert scan.kind == "jsonl" and scan.classes == ("1", "3") and not scan.has_splits


@pytest.mark.parametrize("content, message", [
    ("path,label,colour\nimgs/a/img_0000.jpg,a,red\n", "line 1: unknown column 'colour'"),
    ("path,label\nimgs/a/img_0000.jpg,a\nimgs/a/missing.jpg,a\n", "line 3: no such file 'imgs/a/missing.jpg'"),
    ("path,label\nimgs/a/img_0000.jpg,\n", "line 2: empty label"),
    ("path,label\nimgs/a/img_0000.jpg,a\nimgs/a/img_0000.jpg,a\n", "line 3: .* listed twice"),
    ("path\nimgs/a/img_0000.jpg\n", "missing column 'label'"),
])
def test_bad_lists_name_the_file_and_line(tmp_path, content, message):
    write_image_folder(tmp_path / "imgs", ["a"], 1)
    (tmp_path / "list.csv").write_text(content)
    with pytest.raises(InputError, match=message) as info:
        scan_source(tmp_path / "list.csv")
    assert "list.csv" in str(info.value)


def test_folder_errors(tmp_path):
    with pytest.raises(MissingInputError, match="no such file or folder"):
        scan_source(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="holds no class folders"):
        scan_source(tmp_path / "empty")
    write_image_folder(tmp_path / "tree", ["a"], 2)
    (tmp_path / "tree" / "b").mkdir()
    (tmp_path / "tree" / "b" / "notes.txt").write_text("no images here")
    with pytest.raises(InputError, match=r"tree/b: class folder holds no images"):
        scan_source(tmp_path / "tree")
    scan = scan_source(tmp_path / "tree", allow_empty_classes=True)
    assert scan.classes == ("a", "b") and {s.label for s in scan.samples} == {0}


def test_loose_files_in_root_are_ignored(tmp_path):
    write_image_folder(tmp_path, ["a"], 2)
    (tmp_path / "stray.jpg").write_bytes(class_image(0, 0))
    assert scan_source(tmp_path).files_seen == 2
