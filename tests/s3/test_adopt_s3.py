"""Tars adopted in place on object storage: the index on this machine (or in the bucket), the tars under an
``s3://`` prefix the caller names, streamed by their row index in ranged reads, through the node cache too, and
verified against the recorded checksums; and tars indexed straight from an ``s3://`` prefix (listed, each
streamed once), incrementally, a replaced object refused by name. The bucket's objects are never written."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

import shards
from preprocess.adopt.index import index_tars
from shards.check.verify import verify_dataset
from shards.cli.main import main as shards_main
from shards.errors import ChecksumError
from tests.helpers import class_image
from tests.preprocess.test_adopt import make_source, raw, stream, wds

pytestmark = pytest.mark.s3


def objects(bucket) -> dict[str, tuple[str, int]]:
    listing = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=bucket.prefix)
    return {item["Key"]: (item["ETag"], item["Size"]) for item in listing.get("Contents", [])}


@pytest.mark.slow
def test_adopted_tars_stream_and_verify_from_s3(bucket, tmp_path):
    src = make_source(tmp_path)
    index_tars(str(src), str(tmp_path / "index"), label_member="cls", quiet=True)
    tars = bucket.upload(src, "tars")
    before = objects(bucket)
    local = stream(tmp_path / "index", src, sampling=shards.Sampling(shuffle=False))
    remote = stream(tmp_path / "index", tars, sampling=shards.Sampling(shuffle=False))
    assert remote == local and len(local) == 12
    cached = shards.open_dataset(tmp_path / "index", return_keys=True, decode=shards.Decode(decoder=raw),
                                 sampling=shards.Sampling(shuffle=False),
                                 remote=shards.Remote(base_url=tars, shard_cache=shards.ShardCache(
                                     dir=tmp_path / "node-cache")))
    assert [(key, bytes(data), int(label)) for data, label, key in cached] == local
    index_in_bucket = bucket.upload(tmp_path / "index", "index")
    assert stream(index_in_bucket, tars, sampling=shards.Sampling(shuffle=False)) == local
    report = verify_dataset(str(tmp_path / "index"), source=tars, full=True, quiet=True)
    assert report.ok, report.problems
    after = objects(bucket)
    assert {k: v for k, v in after.items() if "/tars/" in k} == before  # the tars' objects untouched


def shard_entries(index) -> list[dict]:
    manifest = json.loads((index / "dataset.json").read_text())
    return [shard for split in manifest["splits"].values() for shard in split["shards"]]


@pytest.mark.slow
def test_index_straight_from_s3_matches_the_local_adoption_grows_and_refuses_a_replaced_object(bucket, tmp_path):
    src = make_source(tmp_path)
    index_tars(str(src), str(tmp_path / "local"), label_member="cls", quiet=True)
    tars = bucket.upload(src, "tars")
    bucket.put("tars/notes.txt", b"not a tar")  # listed, not indexed
    before = objects(bucket)
    report = index_tars(tars, str(tmp_path / "index"), label_member="cls", quiet=True)
    assert report.source_base == tars and report.indexed == ("a-000.tar", "c-002.tar", "part/b-001.tar")
    assert shard_entries(tmp_path / "index") == shard_entries(tmp_path / "local")  # same sizes, sha256s, rows
    skipped = [json.loads((tmp_path / name / "dataset.json").read_text())["source"]["skipped"]
               for name in ("index", "local")]
    assert skipped[0] == skipped[1] and len(skipped[0]) == 3  # refused alike, named by the tars' names
    record = json.loads((tmp_path / "index" / "dataset.json").read_text())["adoption"]["tars"]["a-000.tar"]
    assert record["etag"] and record["last_modified"] and "mtime_ns" not in record
    local = stream(tmp_path / "local", src, sampling=shards.Sampling(shuffle=False))
    assert stream(tmp_path / "index", tars, sampling=shards.Sampling(shuffle=False)) == local
    assert not list((tmp_path / "index" / ".adopt").iterdir())  # the staged copies are gone
    assert objects(bucket) == before  # the source is never written
    grown = tmp_path / "grown"
    grown.mkdir()
    with wds.TarWriter(str(grown / "d-003.tar")) as writer:
        for i in range(3):
            writer.write({"__key__": f"d{i:03d}", "jpg": class_image(i % 2, 300 + i, size=(12, 10)),
                          "cls": (2, 10)[i % 2]})
    bucket.put("tars/d-003.tar", (grown / "d-003.tar").read_bytes())
    again = index_tars(tars, str(tmp_path / "index"), label_member="cls", quiet=True)
    assert again.indexed == ("d-003.tar",) and again.kept == 3 and again.samples == {"train": 15}
    keys = [key for key, _, _ in stream(tmp_path / "index", tars, sampling=shards.Sampling(shuffle=False))]
    assert sorted(keys) == sorted([key for key, _, _ in local] + ["d000", "d001", "d002"])
    committed = (tmp_path / "index" / "dataset.json").read_bytes()
    data = bytearray((src / "a-000.tar").read_bytes())
    data[600] ^= 1  # same size, other bytes: only its ETag says so
    bucket.put("tars/a-000.tar", bytes(data))
    with pytest.raises(ChecksumError, match=r"tars/a-000\.tar.*changed since it was indexed"):
        index_tars(tars, str(tmp_path / "index"), label_member="cls", quiet=True)
    assert (tmp_path / "index" / "dataset.json").read_bytes() == committed


def test_cli_indexes_an_s3_prefix_with_the_endpoint_option(bucket, tmp_path, monkeypatch):
    src = make_source(tmp_path)
    tars = bucket.upload(src, "tars")
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    result = CliRunner().invoke(shards_main, ["index", tars, "--out", str(tmp_path / "idx"), "--label-member", "cls",
                                              "--s3-endpoint-url", endpoint, "--quiet"])
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout.strip())
    assert line["tars_indexed"] == 3 and line["samples"] == {"train": 12} and line["source_base"] == tars
    missing = CliRunner().invoke(shards_main, ["index", bucket.url("nothing"), "--out", str(tmp_path / "none"),
                                               "--s3-endpoint-url", endpoint, "-q"])
    assert missing.exit_code != 0 and "holds no .tar objects" in missing.stderr
    assert missing.stderr.count("\n") == 1
