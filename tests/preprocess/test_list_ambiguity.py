"""A list that says one thing two ways is refused in one line, never read one way silently: the same file under two
spellings of its path (``imgs/../imgs/x.jpg``), a CSV header naming a column twice, a JSONL row naming a key twice.
The door's ``parse_json(unique_keys=True)`` is what refuses the last."""

from __future__ import annotations

import pytest

from preprocess.pack.sources.scan import scan_source
from shards.door.bounded_read import JSONError, parse_json
from shards.errors import InputError
from tests.helpers import class_image


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "x.jpg").write_bytes(class_image(0, 0, size=(8, 8)))
    (tmp_path / "imgs" / "y.jpg").write_bytes(class_image(1, 1, size=(8, 8)))
    return tmp_path


@pytest.mark.parametrize("name,text,message", [
    ("a.csv", "path,label\nimgs/x.jpg,cat\nimgs/../imgs/x.jpg,dog\n", "line 3: 'imgs/../imgs/x.jpg' is listed twice"),
    ("b.csv", "path,label\n./imgs/x.jpg,cat\nimgs//x.jpg,dog\n", "line 3: 'imgs//x.jpg' is listed twice"),
    ("c.csv", "path,path,label\nimgs/x.jpg,imgs/y.jpg,cat\n", "row 1: column 'path' appears twice in the header"),
    ("d.jsonl", '{"path": "imgs/x.jpg", "label": "a", "label": "b"}\n',
     "line 1: not valid JSON (key 'label' appears twice in one object)"),
])
def test_a_list_that_says_one_thing_two_ways_is_refused(folder, name, text, message):
    (folder / name).write_text(text)
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        scan_source(folder / name)
    assert "\n" not in str(caught.value)


def test_lists_with_each_file_once_scan_under_normalised_names(folder):
    (folder / "ok.csv").write_text("path,label\n./imgs/x.jpg,cat\nimgs/sub/../y.jpg,dog\n")
    (folder / "imgs" / "sub").mkdir()
    scan = scan_source(folder / "ok.csv")
    assert [s.rel_path for s in scan.samples] == ["imgs/x.jpg", "imgs/y.jpg"]


def test_unique_keys_is_asked_for_and_nested_objects_are_checked_too():
    assert parse_json('{"a": 1, "a": 2}') == {"a": 2}  # indexes and metrics: the JSON standard's reading
    with pytest.raises(JSONError, match="key 'a' appears twice"):
        parse_json('{"x": {"a": 1, "a": 2}}', unique_keys=True)
    assert parse_json('{"a": {"a": 1}}', unique_keys=True) == {"a": {"a": 1}}
