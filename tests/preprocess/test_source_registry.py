"""The registry of source kinds: each kind is recognised from its own input, the table is the one place kinds are
named, an input of no kind (or one that cannot be looked at) is one clear line, and ``pack-shards --help`` names
every kind the registry has."""

import ast
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from preprocess.pack.cli import pack_shards_command
from preprocess.pack.sources.members import SourceFields
from preprocess.pack.sources.registry import READERS, SOURCE_KINDS, recognise, source_kind
from preprocess.pack.sources.scan import SourceScan, scan_source
from shards.errors import InputError, MissingInputError
from tests.helpers import write_image_folder

REPO = Path(__file__).resolve().parents[2]
KIND_NAMES = [kind.name for kind in SOURCE_KINDS]


def _tars(tmp_path):
    return str(tmp_path / "shard-{000..001}.tar")  # a pattern is recognised before anything is looked up


def _save_to_disk(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "state.json").write_text("{}")
    return tmp_path / "hf"


def _parquet(tmp_path):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    return tmp_path / "x.parquet"


def _split_trees(tmp_path):
    write_image_folder(tmp_path / "src" / "train", ["a"], 1)
    write_image_folder(tmp_path / "src" / "val", ["a"], 1)
    return tmp_path / "src"


def _tree(tmp_path):
    write_image_folder(tmp_path / "src", ["a"], 1)
    return tmp_path / "src"


def _jsonl(tmp_path):
    (tmp_path / "list.ndjson").write_text(json.dumps({"path": "a.jpg", "label": "a"}) + "\n")
    return tmp_path / "list.ndjson"


def _csv(tmp_path):
    (tmp_path / "list.CSV").write_text("path,label\na.jpg,a\n")
    return tmp_path / "list.CSV"


# One input per kind, recognised from its path or files alone (nothing here is scanned).
INPUTS = {"webdataset": _tars, "hf-arrow": _save_to_disk, "parquet": _parquet, "imagefolder-splits": _split_trees,
          "imagefolder": _tree, "jsonl": _jsonl, "csv": _csv}


def test_every_kind_has_a_sample_input_here():
    assert sorted(INPUTS) == sorted(KIND_NAMES)
    assert len(set(KIND_NAMES)) == len(KIND_NAMES)


@pytest.mark.parametrize("name", KIND_NAMES)
def test_every_registered_kind_is_recognised_from_a_matching_input(tmp_path, name):
    assert recognise(str(INPUTS[name](tmp_path))).name == name


def test_a_save_to_disk_folder_holding_parquet_files_is_save_to_disk(tmp_path):
    source = _save_to_disk(tmp_path)
    (source / "extra.parquet").write_bytes(b"PAR1")
    assert recognise(str(source)).name == "hf-arrow"


@pytest.mark.slow
def test_kinds_are_named_only_in_the_registry():
    """A kind's name as a string constant anywhere else is a branch on kinds the registry does not see. (A
    container format may share a kind's name, ``parquet``: it names a file format, not a source kind.)"""
    kind_only = set(KIND_NAMES) - set(READERS)
    found = []
    for package in ("preprocess", "shards", "train"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "preprocess/pack/sources/registry.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in kind_only:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert found == []


def test_scan_records_the_kind_the_registry_named(tmp_path):
    scan = scan_source(_split_trees(tmp_path))
    assert scan.kind == "imagefolder-splits" and scan.source_kind is source_kind("imagefolder-splits")
    with pytest.raises(ValueError, match="unknown source kind 'folder'"):
        SourceScan("folder", str(tmp_path), ("a",), ())


def _one_line(error: Exception, path: Path) -> str:
    message = str(error)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message


def test_an_unknown_source_is_one_input_error_naming_it_and_every_kind(tmp_path):
    (tmp_path / "notes.txt").write_text("not images")
    with pytest.raises(InputError) as info:
        scan_source(tmp_path / "notes.txt")
    message = _one_line(info.value, tmp_path / "notes.txt")
    assert all(kind.looks_like in message for kind in SOURCE_KINDS)


def test_a_missing_source_is_a_missing_input_error(tmp_path):
    with pytest.raises(MissingInputError, match="no such file or folder") as info:
        scan_source(tmp_path / "nope.csv")
    _one_line(info.value, tmp_path / "nope.csv")


def test_a_source_that_cannot_be_looked_at_is_one_input_error(tmp_path):
    source = tmp_path / ("x" * 300)  # longer than a file name may be: the lookup itself fails
    with pytest.raises(InputError, match="cannot read") as info:
        scan_source(source)
    _one_line(info.value, source)


def _fifo_list(tmp_path):
    os.mkfifo(tmp_path / "list.csv")  # opening it to read would block
    return tmp_path / "list.csv"


def _binary_list(tmp_path):
    (tmp_path / "list.jsonl").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    return tmp_path / "list.jsonl"


@pytest.mark.parametrize("make, reason", [(_fifo_list, "not a regular file"), (_binary_list, "not UTF-8")],
                         ids=["fifo-list", "binary-list"])
def test_an_unreadable_source_is_one_input_error_naming_it(tmp_path, make, reason):
    source = make(tmp_path)
    with pytest.raises(InputError, match=reason) as info:
        scan_source(source)
    _one_line(info.value, source)


def test_an_unreadable_source_exits_2_with_one_line_from_the_command(tmp_path):
    (tmp_path / "notes.txt").write_text("not images")
    result = CliRunner().invoke(pack_shards_command, [str(tmp_path / "notes.txt"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "notes.txt: not a source of a known kind" in errors[0]
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", KIND_NAMES)
def test_options_a_kind_does_not_read_are_refused_not_ignored(tmp_path, name):
    kind = source_kind(name)
    unread = [field for field in ("image_column", "label_column", "label_member", "label_field")
              if field not in kind.fields]
    given = SourceFields(**{unread[0]: "x"})
    with pytest.raises(InputError, match=f"--{unread[0].replace('_', '-')}.* not to {kind.title} sources"):
        scan_source(INPUTS[name](tmp_path), fields=given)


def test_help_names_every_registered_kind():
    result = CliRunner().invoke(pack_shards_command, ["--help"])
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert [kind.title for kind in SOURCE_KINDS if kind.title not in text] == []
