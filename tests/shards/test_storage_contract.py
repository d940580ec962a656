"""The contract every image-shard storage passes: round trip, determinism, checksums, plain-library readability."""

import hashlib

import pytest

from shards.errors import CorruptDataError, ManifestError
from shards.manifest import load_dataset_manifest, load_manifest
from shards.formats.sample import RawSample
from shards.transport.storage import STORAGES
from tests.helpers import make_shard_dataset

SAMPLES = [RawSample(f"k{i:03d}", bytes([i]) * (50 + i), "png" if i % 2 else "jpg", i % 3, b'{"i": %d}' % i)
           for i in range(9)]


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_round_trip_keeps_order_and_bytes(tmp_path, storage):
    spec = STORAGES[storage]
    path = tmp_path / f"s{spec.suffix}"
    with spec.writer(path, classes=["a", "b", "c"]) as writer:
        for sample in SAMPLES:
            writer.write(sample)
    assert list(spec.read(path)) == SAMPLES
    assert list(spec.read_bytes(path.read_bytes(), str(path))) == SAMPLES  # a fetched object, from memory
    assert list(spec.read_slice(path, 2, 5)) == SAMPLES[2:5]
    assert writer.samples == len(SAMPLES)
    assert writer.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert writer.bytes == path.stat().st_size
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_same_samples_give_identical_bytes(tmp_path, storage):
    spec = STORAGES[storage]
    digests = set()
    for run in range(2):
        with spec.writer(tmp_path / f"r{run}{spec.suffix}", classes=["a"]) as writer:
            for sample in SAMPLES:
                writer.write(sample)
        digests.add(writer.sha256)
    assert len(digests) == 1


@pytest.mark.parametrize("storage", sorted(STORAGES))
def test_failed_write_leaves_nothing_under_final_name(tmp_path, storage):
    spec = STORAGES[storage]
    path = tmp_path / f"s{spec.suffix}"
    with pytest.raises(RuntimeError):
        with spec.writer(path) as writer:
            writer.write(SAMPLES[0])
            raise RuntimeError("killed")
    assert not path.exists()


def test_truncated_tar_names_the_shard(tmp_path):
    spec = STORAGES["tar"]
    path = tmp_path / "s.tar"
    with spec.writer(path) as writer:
        for sample in SAMPLES:
            writer.write(sample)
    path.write_bytes(path.read_bytes()[:700])
    with pytest.raises(CorruptDataError, match="s.tar"):
        list(spec.read(path))


def test_manifest_round_trip_and_version_check(tmp_path):
    manifest = make_shard_dataset(tmp_path)
    loaded = load_dataset_manifest(tmp_path)
    assert loaded.to_dict() == manifest.to_dict()
    assert load_manifest(tmp_path).kind == "images"
    data = (tmp_path / "dataset.json").read_text().replace('"version": 1', '"version": 99')
    (tmp_path / "dataset.json").write_text(data)
    with pytest.raises(ManifestError, match="version 99"):
        load_dataset_manifest(tmp_path)


def test_plain_webdataset_reads_tar_shards(tmp_path):
    import webdataset as wds

    manifest = make_shard_dataset(tmp_path)
    urls = [str(tmp_path / s.path) for s in manifest.splits["train"].shards]
    rows = list(wds.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("jpg;png;webp", "cls"))
    assert len(rows) == manifest.splits["train"].samples
    assert [label for _, label in rows[:4]] == [0, 1, 2, 0]
    assert rows[0][0].size == (48, 40)


def test_plain_h5py_reads_hdf5_shards(tmp_path):
    import h5py

    manifest = make_shard_dataset(tmp_path, storage="hdf5")
    with h5py.File(tmp_path / manifest.splits["val"].shards[0].path, "r") as f:
        offsets = f["offsets"][...]
        first = f["data"][offsets[0]:offsets[1]].tobytes()
        assert list(f["labels"][:3]) == [0, 1, 2]
        assert list(f.attrs["classes"]) == ["a", "b", "c"]
    assert first[:2] == b"\xff\xd8"  # a JPEG
