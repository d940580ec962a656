"""``shards index`` of tars behind ``http(s)://``: a brace pattern of URLs (HTTP has no listing), each tar streamed
once through the strict scan, the index equal to the local adoption of the same tars; reruns index only new URLs
and refuse a replaced tar by name; a pattern naming anything outside its base folder is refused unread."""

from __future__ import annotations

import json
import os

import pytest

import shards
from preprocess.adopt.index import index_tars
from shards.errors import ChecksumError, InputError, ManifestError, MissingInputError
from tests.helpers import class_image, serve_folder
from tests.preprocess.test_adopt import make_source, snapshot, stream, wds


def shard_entries(index) -> list[dict]:
    manifest = json.loads((index / "dataset.json").read_text())
    return [shard for split in manifest["splits"].values() for shard in split["shards"]]


@pytest.mark.slow
def test_http_brace_pattern_indexes_like_the_local_tars_grows_and_refuses_a_replaced_tar(tmp_path):
    src = make_source(tmp_path)
    index_tars(str(src), str(tmp_path / "local"), label_member="cls", quiet=True)
    before = snapshot(src)
    local = stream(tmp_path / "local", src, sampling=shards.Sampling(shuffle=False))
    with serve_folder(src) as url:
        report = index_tars(f"{url}/{{a-000,c-002,part/b-001}}.tar", str(tmp_path / "index"), label_member="cls",
                            quiet=True)
        assert report.source_base == url and report.indexed == ("a-000.tar", "c-002.tar", "part/b-001.tar")
        assert shard_entries(tmp_path / "index") == shard_entries(tmp_path / "local")
        record = json.loads((tmp_path / "index" / "dataset.json").read_text())["adoption"]["tars"]["a-000.tar"]
        assert record["last_modified"] and "mtime_ns" not in record
        assert stream(tmp_path / "index", url, sampling=shards.Sampling(shuffle=False)) == local
        assert snapshot(src) == before and not list((tmp_path / "index" / ".adopt").iterdir())
        with wds.TarWriter(str(src / "d-003.tar")) as writer:
            for i in range(3):
                writer.write({"__key__": f"d{i:03d}", "jpg": class_image(i % 2, 300 + i, size=(12, 10)),
                              "cls": (2, 10)[i % 2]})
        grown = f"{url}/{{a-000,c-002,d-003,part/b-001}}.tar"
        again = index_tars(grown, str(tmp_path / "index"), label_member="cls", quiet=True)
        assert again.indexed == ("d-003.tar",) and again.kept == 3 and again.samples == {"train": 15}
        assert index_tars(grown, str(tmp_path / "index"), label_member="cls", quiet=True).indexed == ()
        committed = (tmp_path / "index" / "dataset.json").read_bytes()
        data = bytearray((src / "a-000.tar").read_bytes())
        data[600] ^= 1  # same size, other bytes, a later Last-Modified
        (src / "a-000.tar").write_bytes(bytes(data))
        later = os.stat(src / "a-000.tar").st_mtime_ns + 10**10
        os.utime(src / "a-000.tar", ns=(later, later))
        with pytest.raises(ChecksumError, match=r"/a-000\.tar.*changed since it was indexed"):
            index_tars(grown, str(tmp_path / "index"), label_member="cls", quiet=True)
        assert (tmp_path / "index" / "dataset.json").read_bytes() == committed


@pytest.mark.slow
def test_http_pattern_outside_its_base_or_naming_a_missing_tar_is_refused_by_name(tmp_path):
    src = tmp_path / "src"
    (src / "part").mkdir(parents=True)
    for name in ("a-000.tar", "part/b-001.tar"):
        with wds.TarWriter(str(src / name)) as writer:
            writer.write({"__key__": name[0], "jpg": class_image(0, 0, size=(4, 4)), "cls": 0})
    with serve_folder(src) as url:
        with pytest.raises(ManifestError, match=r"\.\./"):
            index_tars(f"{url}/part/{{b-001,../a-000}}.tar", str(tmp_path / "index"), quiet=True)
        with pytest.raises(MissingInputError, match="nope.tar"):
            index_tars(f"{url}/{{a-000,nope}}.tar", str(tmp_path / "index"), quiet=True)
        with pytest.raises(InputError, match="no listing"):
            index_tars(f"{url}/part", str(tmp_path / "index"), quiet=True)
    assert not (tmp_path / "index" / "dataset.json").exists()
