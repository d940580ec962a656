"""The location layer (``shards.transport.location``): one object per place bytes come from. Every kind reads the same
shard to the same samples, fetches it whole checked against the manifest, copies it for a whole-file check, reads
manifests within the bounded-read rules, and joins names under the confinement rules. Object storage passes the
same checks in ``tests/s3/test_location_s3.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shards.errors import ChecksumError, ManifestError, MissingInputError
from shards.transport.location import HttpUrl, LocalFile, PipeCommand, S3Object, locate
from shards.transport.manifest_io import dataset_sha256_at, load_manifest_at, read_dataset_manifest
from shards.transport.storage import get_storage
from shards.manifest import load_dataset_manifest
from tests.helpers import make_shard_dataset, serve_folder

SHARD = "train-000000.tar"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    make_shard_dataset(folder, shard_sizes={"train": [6, 3]}, size=(16, 16))
    with serve_folder(folder) as url:
        yield folder, url


def shard_at(kind: str, folder: Path, url: str):
    return {"local": locate(folder / SHARD), "http": locate(f"{url}/{SHARD}"),
            "pipe": locate(f"pipe:cat {folder / SHARD}")}[kind]


KINDS = ["local", "http", "pipe"]


def test_the_scheme_alone_picks_the_kind():
    assert type(locate("s3://bucket/data/x.tar")) is S3Object
    assert type(locate("http://host/x.tar")) is HttpUrl and type(locate("https://host/x.tar")) is HttpUrl
    assert type(locate("pipe:cat x.tar")) is PipeCommand
    for local in ("data/x.tar", "/abs/x.tar", Path("x.tar"), "gs://not-ours/x.tar"):
        assert type(locate(local)) is LocalFile
    where = locate("s3://bucket/data")
    assert locate(where) is where
    assert locate("x").local_path() == Path("x") and locate("s3://b/x").local_path() is None
    assert locate("pipe:cat x").local_path() is None and locate("http://h/x").local_path() is None
    assert locate("x").can_list and locate("s3://b/x").can_list and not locate("http://h/x").can_list
    assert locate("s3://b/x").uses_storage_options and not locate("http://h/x").uses_storage_options
    assert locate("s3://b/x").publishable and not locate("x").publishable and not locate("http://h/x").publishable
    assert not locate("pipe:cat x").addressable and locate("http://h/x").addressable
    assert locate("x").record() == os.path.abspath("x") and locate("s3://b/x").record() == "s3://b/x"


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_reads_the_same_slices(served, kind):
    folder, url = served
    info = load_dataset_manifest(folder).splits["train"].shards[0]
    storage = get_storage("tar")
    truth = [s.key for s in storage.read(folder / SHARD)]
    where = shard_at(kind, folder, url)
    for start, stop in ((0, 6), (2, 5), (5, 6), (3, 3)):
        got = [s.key for s in where.read_slice(storage, start, stop, size=info.bytes, sha256=info.sha256)]
        assert got == truth[start:stop]


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_fetch_is_checked_against_the_manifest(served, kind):
    folder, url = served
    info = load_dataset_manifest(folder).splits["train"].shards[0]
    where = shard_at(kind, folder, url)
    assert where.fetch_checked(info.bytes, info.sha256) == (folder / SHARD).read_bytes()
    with pytest.raises(ChecksumError, match="sha256 does not match"):
        where.fetch_checked(info.bytes, "0" * 64)
    with pytest.raises(ChecksumError, match=f"more than .* the manifest records {info.bytes - 10}"):
        where.fetch_checked(info.bytes - 10, None)
    with pytest.raises(ChecksumError, match=f"{info.bytes} bytes, the manifest records {info.bytes + 10}"):
        where.fetch_checked(info.bytes + 10, None)
    # The same check without keeping the bytes (what precompute-features runs before writing a shard's features).
    assert where.check(info.bytes, info.sha256) is None
    with pytest.raises(ChecksumError, match="sha256 does not match"):
        where.check(info.bytes, "0" * 64)
    with pytest.raises(ChecksumError, match=f"the manifest records {info.bytes - 10}"):
        where.check(info.bytes - 10, info.sha256)


@pytest.mark.parametrize("kind", KINDS)
def test_a_local_copy_holds_the_bytes_under_the_shards_name(served, kind):
    folder, url = served
    where = shard_at(kind, folder, url)
    data = (folder / SHARD).read_bytes()
    with where.local_copy() as path:
        assert path.name == SHARD and path.read_bytes() == data
    if kind == "local":
        assert path == folder / SHARD  # read in place, never copied
        return
    assert not path.exists()  # the temporary copy is gone
    with where.local_copy(limit=100) as path:
        assert path.read_bytes() == data[:100]


def test_children_are_confined_own_files_are_ours(served, tmp_path):
    folder, url = served
    assert locate(folder).child(SHARD) == LocalFile(str(folder / SHARD))
    (tmp_path / "outside.tar").write_bytes(b"x")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "link.tar").symlink_to(tmp_path / "outside.tar")
    with pytest.raises(ManifestError, match="outside the dataset folder"):
        locate(tmp_path / "data").child("link.tar")
    with pytest.raises(ManifestError, match="'..' part"):
        locate(folder).child("../x.tar")
    with pytest.raises(ManifestError, match="source index path 'pipe:x'"):
        locate(folder).child("pipe:x", what="source index")
    s3 = locate("s3://bucket/prefix/", storage_options={"unsigned": True}).child("a/b.tar")
    assert s3 == S3Object("s3://bucket/prefix/a/b.tar") and s3.storage_options == {"unsigned": True}
    web = locate(url, origins=["http://mirror:1"]).child("a b?.tar")
    assert web.text == f"{url}/a%20b%3F.tar" and web.origins == ("http://mirror:1",)
    with pytest.raises(ManifestError, match="pipe: location cannot hold"):
        locate("pipe:cat x").child(SHARD)
    assert locate(folder).file("dataset.json").path == folder / "dataset.json"
    assert locate("s3://bucket/prefix/").file("dataset.json").text == "s3://bucket/prefix/dataset.json"


def test_small_files_are_read_bounded_and_missing_ones_are_named(served, tmp_path):
    folder, url = served
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100 + "]" * 100)
    with pytest.raises(ManifestError, match="deep.json.*deeper than 64"):
        locate(deep).read_json()
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(ManifestError, match="fifo.json"):  # refused without being opened: no hang
        locate(tmp_path / "fifo.json").read_json()
    for where in (locate(tmp_path / "gone.json"), locate(f"{url}/gone.json")):
        with pytest.raises(MissingInputError, match="gone.json"):
            where.read_json()
    assert locate(f"{url}/dataset.json").read_json() == locate(folder / "dataset.json").read_json()


def test_manifests_load_by_one_rule_wherever_they_are(served, tmp_path):
    folder, url = served
    local, local_base = load_manifest_at(folder)
    remote, remote_base = load_manifest_at(url)
    assert local == remote and local_base == str(folder) and remote_base == url
    assert load_manifest_at(f"{url}/dataset.json")[1] == url
    assert load_manifest_at(folder / "dataset.json")[1] == str(folder)
    manifest, digest = read_dataset_manifest(folder)
    assert manifest == local and digest == dataset_sha256_at(folder) == dataset_sha256_at(url)
    with pytest.raises(MissingInputError, match="no dataset.json or features.json under this prefix"):
        load_manifest_at(f"{url}/nothing-here")


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_local_shard_that_is_not_a_regular_file_is_refused_unopened(tmp_path, kind):
    """A FIFO in a shard's place would block ``open()`` until a writer came (a cache fetch or a check hangs)."""
    import time

    from shards.errors import CorruptDataError

    shard = tmp_path / "train-000000.tar"
    os.mkfifo(shard) if kind == "fifo" else shard.mkdir()
    started = time.monotonic()
    with pytest.raises(CorruptDataError, match=r"train-000000\.tar: not a regular file"):
        locate(str(shard)).check(10, None)
    assert time.monotonic() - started < 5


def test_a_shard_that_is_a_fifo_is_not_called_missing(tmp_path):
    from shards.errors import CorruptDataError

    os.mkfifo(tmp_path / "train-000000.tar")
    with pytest.raises(CorruptDataError, match="is not a regular file .FIFO."):
        locate(str(tmp_path / "train-000000.tar")).check_image_shard(get_storage("tar"))
    with pytest.raises(MissingInputError, match="missing"):
        locate(str(tmp_path / "train-000001.tar")).check_image_shard(get_storage("tar"))
