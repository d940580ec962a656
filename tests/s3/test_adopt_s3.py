"""Tars adopted in place on object storage: the index on this machine (or in the bucket), the tars under an
``s3://`` prefix the caller names, streamed by their row index in ranged reads, through the node cache too, and
verified against the recorded checksums; the bucket's objects are never written."""

from __future__ import annotations

import pytest

import shards
from preprocess.adopt.index import index_tars
from shards.check.verify import verify_dataset
from tests.preprocess.test_adopt import make_source, raw, stream

pytestmark = pytest.mark.s3


def objects(bucket) -> dict[str, tuple[str, int]]:
    listing = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=bucket.prefix)
    return {item["Key"]: (item["ETag"], item["Size"]) for item in listing.get("Contents", [])}


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
