"""File and folder names that are not UTF-8 (an old archive's Latin-1 names, which Python carries as surrogate
escapes): a manifest cannot hold them. A file is skipped with its reason and the rest packs; a class folder, the
source itself or a container's name is refused in one line naming it printably; the run never ends in a traceback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from preprocess.pack.packer import PackConfig, pack_manifest
from preprocess.pack.sources.columns import SamplesBuilder, printable_name
from preprocess.pack.sources.scan import scan_source
from shards.errors import InputError
from shards.manifest import load_dataset_manifest
from tests.helpers import class_image, write_image_folder

LATIN1 = os.fsdecode(b"caf\xe9")  # 'caf\udce9'


def test_a_file_named_in_latin1_is_skipped_and_the_rest_packs(tmp_path: Path):
    src = write_image_folder(tmp_path / "src", ["cat", "dog"], 3)
    (src / "cat" / f"{LATIN1}.jpg").write_bytes(class_image(0, 9))
    scan = scan_source(src)
    assert len(scan.samples) == 6
    assert [(s.rel_path, s.reason) for s in scan.skipped] == [("cat/caf\\xe9.jpg",
                                                               "file name is not valid UTF-8 (rename it)")]
    pack_manifest(PackConfig(source=str(src), out=str(tmp_path / "out"), quiet=True))
    manifest = load_dataset_manifest(tmp_path / "out")
    assert manifest.splits["train"].samples == 6 and manifest.splits["train"].class_counts == (3, 3)


def test_a_class_folder_or_a_source_named_in_latin1_is_refused_in_one_line(tmp_path: Path):
    src = write_image_folder(tmp_path / "src", ["cat"], 2)
    (src / LATIN1).mkdir()
    (src / LATIN1 / "a.jpg").write_bytes(class_image(0, 1))
    with pytest.raises(InputError, match="class folder name is not valid UTF-8") as caught:
        scan_source(src)
    assert "caf\\xe9" in str(caught.value) and "\n" not in str(caught.value)
    root = write_image_folder(tmp_path / LATIN1, ["cat"], 2)
    with pytest.raises(InputError, match="path is not valid UTF-8") as caught:
        scan_source(root)
    assert str(caught.value).encode("utf-8")  # printable: no surrogate left in the message


def test_a_member_or_container_name_that_is_not_utf8_is_refused_naming_it():
    builder = SamplesBuilder("/data")
    builder.add("ok.tar", 0, None, 1, 0)
    with pytest.raises(InputError, match="not valid UTF-8") as caught:
        builder.add(f"{LATIN1}.tar", 0, None, 1, 0)
    assert "/data/caf\\xe9.tar" in str(caught.value)
    assert printable_name("plain/ü.jpg") == "plain/ü.jpg"
