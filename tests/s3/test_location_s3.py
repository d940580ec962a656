"""The location layer on object storage (a local SeaweedFS): an ``s3://`` location passes the checks every other
kind passes (``tests/shards/test_location.py``), and ``shards verify`` is one implementation: the same damage gives
the same problems whether the dataset is local or in a bucket."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from shards.check.verify import verify_dataset
from shards.cli.main import main
from shards.errors import ChecksumError, MissingInputError
from shards.transport import s3
from shards.transport.location import S3Object, locate
from shards.transport.manifest_io import dataset_sha256_at, load_manifest_at, read_dataset_manifest
from shards.transport.storage import get_storage
from shards.manifest import load_dataset_manifest
from tests.s3.test_read import packed

pytestmark = pytest.mark.s3


@pytest.mark.parametrize("storage", ["tar", "hdf5"])
def test_an_s3_location_reads_slices_fetches_and_copies_like_a_local_one(bucket, tmp_path, storage):
    local = packed(tmp_path / "data", storage)
    url = bucket.upload(local, "data")
    manifest = load_dataset_manifest(local)
    info = manifest.splits["train"].shards[1]
    where = locate(url).child(info.path)
    assert isinstance(where, S3Object)
    reader = get_storage(storage)
    truth = [s.key for s in reader.read(local / info.path)]
    offsets = where.load_index(info)
    assert (offsets is None) == (storage == "hdf5")
    for start, stop in ((0, info.samples), (1, 4), (4, 4)):
        assert [s.key for s in where.read_slice(reader, start, stop, size=info.bytes, offsets=offsets)] == \
            truth[start:stop]
    data = (local / info.path).read_bytes()
    assert where.fetch_checked(info.bytes, info.sha256) == data
    with pytest.raises(ChecksumError, match="sha256 does not match"):
        where.fetch_checked(info.bytes, "0" * 64)
    s3.FETCH_STATS.reset()
    with where.local_copy(limit=info.bytes + 1) as path:
        assert path.name == info.path and path.read_bytes() == data
    assert s3.FETCH_STATS.bytes == len(data)  # one streaming read
    assert not path.exists()
    with pytest.raises(MissingInputError, match="404"):
        with locate(url).child("gone.tar").local_copy():
            pass


def test_manifests_and_their_digest_come_from_one_read(bucket, tmp_path):
    local = packed(tmp_path / "data")
    url = bucket.upload(local, "data")
    manifest, base = load_manifest_at(url)
    assert manifest == load_dataset_manifest(local) and base == url
    s3.FETCH_STATS.reset()
    again, digest = read_dataset_manifest(url)
    assert again == manifest and digest == dataset_sha256_at(local) and s3.FETCH_STATS.requests == 1


def _same_words(problems) -> list[str]:
    """Problems with the folder a shard was read from taken out (a local path, or its temporary copy)."""
    return sorted(re.sub(r"\S*/((train|val)-\d+\.tar)", r"\1", p) for p in problems)


@pytest.mark.slow
def test_verify_finds_the_same_problems_locally_and_on_s3(bucket, tmp_path):
    local = packed(tmp_path / "data")
    names = [s.path for s in load_dataset_manifest(local).splits["train"].shards]
    truncated, gone, flipped = (local / name for name in names)
    truncated.write_bytes(truncated.read_bytes()[:3000])
    gone.unlink()
    data = bytearray(flipped.read_bytes())
    data[len(data) // 3] ^= 0x01
    flipped.write_bytes(bytes(data))
    (local / "val-000000.tar.idx").write_bytes(b"not an index")
    url = bucket.upload(local, "data")
    here, there = verify_dataset(local), verify_dataset(url)
    assert not here.ok and _same_words(here.problems) == _same_words(there.problems)
    assert f"{names[1]}: missing" in there.problems  # a missing object is a problem to report, not a 404 exit
    assert any(p.startswith(f"{names[0]}: size") for p in there.problems)
    assert any(p.startswith(f"{names[2]}: sha256") for p in there.problems)
    assert any(p.startswith("val-000000.tar.idx: ") for p in there.problems)
    assert (here.shards_checked, here.samples_read) == (there.shards_checked, there.samples_read)
    result = CliRunner().invoke(main, ["verify", url])
    assert result.exit_code == 1 and f"{names[1]}: missing" in result.stderr
