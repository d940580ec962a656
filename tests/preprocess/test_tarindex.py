"""The per-sample byte index of tar shards (``<shard>.idx``): format, checks, packing, seeking, old datasets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from preprocess.pack.packer import PackConfig, pack
from shards.check.verify import verify_dataset
from shards.errors import ChecksumError, CorruptDataError
from shards.formats.tarindex import MAGIC, index_bytes, index_name, load_local_index, read_index
from shards.formats.tarseek import iter_tar_slice, tar_sample_offsets
from shards.manifest import load_dataset_manifest
from tests.helpers import write_image_folder


@pytest.fixture
def packed(tmp_path) -> Path:
    src = write_image_folder(tmp_path / "src", ["a", "b"], per_class=6)
    out = tmp_path / "out"
    pack(PackConfig(source=str(src), out=str(out), max_samples=5, quiet=True))
    return out


def test_round_trip():
    offsets = [0, 1536, 4096, 9000]
    data = index_bytes(offsets)
    assert data[:8] == MAGIC and len(data) == 16 + 8 * 4
    assert read_index(data, "x.idx", 3, 10240).tolist() == offsets
    assert index_name("train-000001.tar") == "train-000001.tar.idx"


@pytest.mark.parametrize("mutate, why", [
    (lambda d: d[:10], "shorter than its header"),
    (lambda d: b"NOTIDX\0\0" + d[8:], "wrong magic"),
    (lambda d: b"SCIDX\0\2\0" + d[8:], "unknown version"),
    (lambda d: d[:8] + (4).to_bytes(8, "little") + d[16:], "holds 4 samples"),
    (lambda d: d + b"\0" * 8, "bytes, expected"),
    (lambda d: d[:16] + (8).to_bytes(8, "little") + d[24:], "first offset"),
    (lambda d: d[:24] + (5000).to_bytes(8, "little") + d[32:], "rise strictly"),
    (lambda d: d[:-8] + (99999).to_bytes(8, "little"), "past the end"),
    (lambda d: d[:-8] + (2 ** 64 - 1).to_bytes(8, "little"), "out of range"),
])
def test_every_corruption_is_refused_naming_the_sidecar(mutate, why):
    data = mutate(index_bytes([0, 1536, 4096, 9000]))
    with pytest.raises(CorruptDataError, match=why) as info:
        read_index(data, "train-000000.tar.idx", 3, 10240)
    assert "train-000000.tar.idx" in str(info.value)


def test_packing_writes_a_sidecar_per_tar_shard_matching_its_samples(packed):
    manifest = load_dataset_manifest(packed)
    for shard in manifest.splits["train"].shards:
        assert shard.index == index_name(shard.path)
        data = (packed / shard.index).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard.index_sha256
        offsets = load_local_index(packed / shard.path, shard)
        assert offsets.tolist() == tar_sample_offsets(packed / shard.path)
    assert verify_dataset(packed).ok


def test_sidecars_are_deterministic(tmp_path):
    src = write_image_folder(tmp_path / "src", ["a", "b"], per_class=6)
    runs = []
    for name in ("one", "two"):
        pack(PackConfig(source=str(src), out=str(tmp_path / name), max_samples=5, quiet=True))
        runs.append({p.name: p.read_bytes() for p in sorted((tmp_path / name).glob("*.idx"))})
    assert runs[0] == runs[1] and len(runs[0]) == 3


def test_seeking_with_the_index_equals_walking_the_headers(packed):
    shard = load_dataset_manifest(packed).splits["train"].shards[0]
    offsets = load_local_index(packed / shard.path, shard)
    for start, stop in [(0, 5), (1, 3), (4, 5), (2, None), (5, None)]:
        walked = list(iter_tar_slice(packed / shard.path, start, stop))
        seeked = list(iter_tar_slice(packed / shard.path, start, stop, offsets=offsets))
        assert seeked == walked


def test_a_damaged_sidecar_is_refused_and_verify_reports_it(packed):
    shard = load_dataset_manifest(packed).splits["train"].shards[0]
    path = packed / shard.index
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        load_local_index(packed / shard.path, shard)
    report = verify_dataset(packed)
    assert any(shard.index in problem for problem in report.problems)


def test_old_manifests_without_an_index_still_read(packed):
    import shards

    manifest_path = packed / "dataset.json"
    doc = json.loads(manifest_path.read_text())
    for split in doc["splits"].values():
        for shard in split["shards"]:
            shard.pop("index"), shard.pop("index_sha256")
    manifest_path.write_text(json.dumps(doc))
    for idx in packed.glob("*.idx"):
        idx.unlink()
    manifest = load_dataset_manifest(packed)
    assert all(s.index is None for s in manifest.splits["train"].shards)
    assert "index" not in manifest.splits["train"].shards[0].to_dict()
    assert verify_dataset(packed).ok
    keys = [key for _, _, key in shards.open_dataset(packed, split="train", return_keys=True,
                                                     sampling=shards.Sampling(shuffle=False))]
    assert len(keys) == manifest.splits["train"].samples == len(set(keys))


def test_streaming_reader_seeks_with_the_sidecar(packed, monkeypatch):
    from shards.formats import tarindex as index_module
    from shards.stream import image_dataset as dataset_module
    from shards.stream.dataset import StreamConfig
    from shards.order.plan import ShardSlice

    manifest = load_dataset_manifest(packed)
    split = manifest.splits["train"]
    locations = [str(packed / s.path) for s in split.shards]
    ds = dataset_module.ImageShardDataset(split, locations, StreamConfig(), storage="tar")
    loads = []
    real = index_module.load_local_index
    monkeypatch.setattr(index_module, "load_local_index", lambda *a: loads.append(a) or real(*a))
    first = [s.key for s in ds.read_slice(ShardSlice(0, 2, 5))]
    again = [s.key for s in ds.read_slice(ShardSlice(0, 3, 4))]
    walked = [s.key for s in iter_tar_slice(locations[0], 2, 5)]
    assert first == walked and again == walked[1:2] and len(loads) == 1
    assert isinstance(real(locations[0], split.shards[0]), np.ndarray)
