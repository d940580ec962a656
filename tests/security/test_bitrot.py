"""Bit rot, as a bad disk or a careless copy makes it: one flipped byte costs the one sample it lands in.

A flipped byte in a tar header's checksum field, an HDF5 offset past the data, a ``.cls`` digit or an HDF5 label
out of range: under ``ErrorPolicy("skip")`` exactly that sample is skipped (logged once, naming shard and key
once), the epoch keeps its length and its order, and skipped slots are filled by different good samples; with
``on_error="raise"`` the first one is a ``CorruptDataError`` naming the key. The same on every read path: a local
tar with and without its byte index, its node-local copy, an http stream, S3 (ranged reads by the index, or a
stream without it) and HDF5.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
from pathlib import Path

import h5py
import pytest

import shards
from shards.errors import CorruptDataError
from shards.formats.sample import RawSample
from shards.transport.storage import get_storage, shard_name
from shards.manifest import DatasetManifest, ShardInfo, SplitInfo
from shards.provenance import SourceInfo
from tests.helpers import class_image, serve_folder
from tests.s3.conftest import bucket, s3_env, s3_server  # noqa: F401 (the S3 fixtures)
from tests.security.test_corrupt_shards import header_offsets, rewrite

CLASSES = ("a", "b", "c")
SKIP = shards.ErrorPolicy("skip")
SAMPLES = 40


# -- a dataset as pack-shards leaves it, and the damage -------------------------------------------------------------
def write_dataset(folder: Path, sizes=(SAMPLES,), *, storage: str = "tar", label_of=lambda n: n % 3) -> list[str]:
    """Shards with what ``pack-shards`` records beside them: per-shard class counts and (tar) the byte index.
    Returns every key in row order."""
    folder.mkdir(parents=True, exist_ok=True)
    writer_type = get_storage(storage).writer
    infos, keys, totals = [], [], [0] * len(CLASSES)
    for index, size in enumerate(sizes):
        counts = [0] * len(CLASSES)
        with writer_type(folder / shard_name("train", index, storage), classes=CLASSES) as writer:
            for _ in range(size):
                n = len(keys)
                keys.append(f"s{n:05d}")
                counts[label_of(n)] += 1
                writer.write(RawSample(keys[-1], class_image(label_of(n), n, (12, 12)), "jpg", label_of(n), b"{}"))
        totals = [a + b for a, b in zip(totals, counts)]
        infos.append(ShardInfo(writer.path.name, writer.samples, writer.bytes, writer.sha256,
                               index=getattr(writer, "index", None),
                               index_sha256=getattr(writer, "index_sha256", None), class_counts=tuple(counts)))
    split = SplitInfo(len(keys), tuple(totals), tuple(infos))
    DatasetManifest(storage=storage, classes=CLASSES, splits={"train": split}, packing={"seed": 0},
                    source=SourceInfo(kind="generated", root="", files_seen=len(keys))).save(folder)
    return keys


def drop_index(folder: Path) -> None:
    """An older dataset: no byte index recorded, no sidecar: readers scan the headers."""
    path = folder / "dataset.json"
    document = json.loads(path.read_text())
    for shard in document["splits"]["train"]["shards"]:
        shard.pop("index"), shard.pop("index_sha256")
    path.write_text(json.dumps(document))
    for sidecar in folder.glob("*.idx"):
        sidecar.unlink()


def flip_checksum_byte(shard: Path, *members: str) -> None:
    """One byte of each header's checksum field changed, digit to digit; ``dataset.json`` keeps the old sha256."""
    offsets = header_offsets(shard)
    data = bytearray(shard.read_bytes())
    for member in members:
        data[offsets[member] + 150] ^= 0x01
    shard.write_bytes(bytes(data))


def overwrite_headers(shard: Path, *members: str, zeros: bool = False) -> None:
    """Headers overwritten with seeded noise (or zeros): nothing in them can be trusted, their names included."""
    offsets = header_offsets(shard)
    data = bytearray(shard.read_bytes())
    for number, member in enumerate(members):
        data[offsets[member]:offsets[member] + 512] = bytes(512) if zeros else random.Random(number).randbytes(512)
    shard.write_bytes(bytes(data))


def flip_label_bit(shard: Path, key: str, bit: int) -> None:
    """One bit of a sample's ``.cls`` digit flipped (``0`` -> ``8`` with 0x08): the tar itself stays valid."""
    data = bytearray(shard.read_bytes())
    data[header_offsets(shard)[f"{key}.cls"] + 512] ^= bit
    shard.write_bytes(bytes(data))


def raw(sample, seed):
    return sample.key


def epoch(location, *, errors=SKIP, **options) -> tuple[list[str], object]:
    dataset = shards.open_dataset(location, return_keys=True, decode=shards.Decode(decoder=raw), errors=errors,
                                  **options, sampling=shards.Sampling(shuffle=False))
    return [key for _, _, key in dataset], dataset


def skip_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping unreadable sample")]


def assert_costs_exactly(keys: list[str], got: list[str], dataset, lost: set[str], caplog) -> None:
    """Exactly ``lost`` is missing, the length is the manifest's, each skip is one line naming shard and key once."""
    assert len(got) == len(keys) == len(dataset)
    assert set(keys) - set(got) == lost
    assert dataset.skipped == len(lost)
    lines = skip_lines(caplog)
    assert len(lines) == len(lost), lines
    for key in lost:
        line = next(line for line in lines if key in line)
        assert line.count(key) == 1 and len(re.findall(r"train-\d{6}\.", line)) == 1, line


def order_with_stand_ins(keys: list[str], lost: str) -> list[str]:
    """The epoch's order with ``lost``'s slot filled by the good sample before it (after it, for the first)."""
    at = keys.index(lost)
    if at == 0:
        return [keys[1], keys[1], *keys[2:]]
    return keys[:at] + [keys[at - 1]] + keys[at + 1:]




# -- damaged tar headers --------------------------------------------------------------------------------------------
def reach(read_path: str, folder: Path, tmp_path: Path):
    """A context manager giving the dataset's location by ``read_path``, and the options that read it that way."""
    if read_path == "no-index":
        drop_index(folder)
    if read_path == "node-cache":  # a copy must match dataset.json's sha256: the shard was packed damaged
        shard = folder / "train-000000.tar"
        rewrite(folder, shard.name, shard.read_bytes())
        node_cache = shards.ShardCache(tmp_path / "cache", local=True)
        return contextlib.nullcontext(folder), {"remote": shards.Remote(shard_cache=node_cache)}
    if read_path == "http":
        return serve_folder(folder), {}
    return contextlib.nullcontext(folder), {}


@pytest.mark.parametrize("read_path", ["indexed", "no-index", "node-cache", "http"])
@pytest.mark.parametrize("member", ["s00000.jpg", "s00020.jpg", "s00020.cls", "s00039.json"],
                         ids=["first-header", "middle-sample", "middle-member", "last-member"])
@pytest.mark.slow
def test_a_flipped_checksum_byte_costs_exactly_its_sample(tmp_path, read_path, member, caplog):
    folder = tmp_path / "data"
    keys = write_dataset(folder)
    lost = member.split(".")[0]
    flip_checksum_byte(folder / "train-000000.tar", member)
    context, options = reach(read_path, folder, tmp_path)
    with context as location, caplog.at_level(logging.WARNING):
        got, dataset = epoch(location, **options)  # default max_consecutive_errors: the epoch completes
        assert_costs_exactly(keys, got, dataset, {lost}, caplog)
        assert got == order_with_stand_ins(keys, lost)  # rows stay aligned with the manifest

        with pytest.raises(CorruptDataError) as info:
            epoch(location, errors=shards.ErrorPolicy("raise"), **options)
    assert info.value.key == lost and "bad tar header at byte" in str(info.value)


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "no-index"])
def test_a_rank_whose_slice_starts_at_the_damaged_sample_loses_only_it(tmp_path, indexed, caplog):
    folder = tmp_path / "data"
    keys = write_dataset(folder)
    flip_checksum_byte(folder / "train-000000.tar", "s00020.jpg")  # rank 1's first sample (seeked to, indexed)
    if not indexed:
        drop_index(folder)
    with caplog.at_level(logging.WARNING):
        ranks = [epoch(folder, distributed=shards.Distributed(rank, 2)) for rank in (0, 1)]
    assert [len(got) for got, _ in ranks] == [20, 20]
    assert set(keys) - {key for got, _ in ranks for key in got} == {"s00020"}
    assert ranks[1][0] == ["s00021", "s00021", *keys[22:]]
    assert len(skip_lines(caplog)) == 1


def test_several_damaged_samples_are_stood_in_for_by_different_ones(tmp_path, caplog):
    folder = tmp_path / "data"
    keys = write_dataset(folder)
    shard = folder / "train-000000.tar"
    damaged = [f"s{n:05d}" for n in (0, 1, 2, 12, 13, 14, 15, 16, 30)]
    flip_checksum_byte(shard, *(f"{key}.jpg" for key in damaged))
    with caplog.at_level(logging.WARNING):
        got, dataset = epoch(folder)
    assert_costs_exactly(keys, got, dataset, set(damaged), caplog)
    stand_ins = [key for key in set(got) if got.count(key) > 1]
    assert sum(got.count(key) - 1 for key in stand_ins) == len(damaged)
    assert len(stand_ins) >= 8, got  # a run of five took five different samples, the leading three the next ones
    assert got[:6] == ["s00003", "s00003", "s00004", "s00004", "s00005", "s00005"]


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed", "no-index"])
@pytest.mark.parametrize("zeros", [False, True], ids=["noise", "zeroed-sector"])
def test_a_header_overwritten_costs_one_sample(tmp_path, indexed, zeros, caplog):
    """No name left to read in the header (noise may still read as one; zeros read as the end of the archive, but
    data follows them): the sample's next member names it."""
    folder = tmp_path / "data"
    keys = write_dataset(folder)
    overwrite_headers(folder / "train-000000.tar", "s00020.jpg", zeros=zeros)
    if not indexed:
        drop_index(folder)
    with caplog.at_level(logging.WARNING):
        got, dataset = epoch(folder)
    assert len(got) == len(keys) and set(keys) - set(got) == {"s00020"} and dataset.skipped == 1
    (line,) = skip_lines(caplog)
    assert "[sample s00020]" in line, line


def test_with_the_index_a_sample_whose_every_header_is_noise_costs_only_itself(tmp_path, caplog):
    folder = tmp_path / "data"
    keys = write_dataset(folder)
    overwrite_headers(folder / "train-000000.tar", "s00020.jpg", "s00020.cls", "s00020.json")
    with caplog.at_level(logging.WARNING):
        got, dataset = epoch(folder)
    assert got == order_with_stand_ins(keys, "s00020") and dataset.skipped == 1
    (line,) = skip_lines(caplog)
    assert "sample 20 of the shard" in line, line  # no key left anywhere: its position names it


def test_a_forged_header_in_a_stream_without_index_resyncs_at_the_next_header(tmp_path, caplog):
    """A member size that runs past the file: the bytes it claims are scanned block by block, not skipped."""
    folder = tmp_path / "data"
    keys = write_dataset(folder)
    drop_index(folder)
    shard = folder / "train-000000.tar"
    data = bytearray(shard.read_bytes())
    at = header_offsets(shard)["s00007.jpg"]
    data[at + 124:at + 136] = b"77777777777\0"  # 8 GB, in a header resealed by a forger
    data[at + 148:at + 156] = b" " * 8
    data[at + 148:at + 156] = b"%06o\0 " % sum(data[at:at + 512])
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        got, dataset = epoch(folder)
    assert_costs_exactly(keys, got, dataset, {"s00007"}, caplog)


def test_a_damaged_index_sidecar_costs_nothing_but_speed(tmp_path, caplog):
    """The index only says where samples start: a bad byte in it is reported, and the shard read by its headers."""
    folder = tmp_path / "data"
    keys = write_dataset(folder)
    sidecar = folder / "train-000000.tar.idx"
    data = bytearray(sidecar.read_bytes())
    data[-3] ^= 0x10
    sidecar.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        ranks = [epoch(folder, errors=shards.ErrorPolicy("raise"), distributed=shards.Distributed(rank, 2))[0]
                 for rank in (0, 1)]
    assert ranks == [keys[:20], keys[20:]]
    assert any("train-000000.tar.idx" in r.getMessage() and "scanning" in r.getMessage() for r in caplog.records)


# -- S3 -------------------------------------------------------------------------------------------------------------
@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.parametrize("indexed", [True, False], ids=["ranged-by-index", "stream-no-index"])
def test_on_s3_a_flipped_checksum_byte_costs_exactly_its_sample(tmp_path, bucket, indexed, caplog):  # noqa: F811
    folder = tmp_path / "data"
    keys = write_dataset(folder, sizes=(24, 16))
    flip_checksum_byte(folder / "train-000000.tar", "s00000.jpg")
    flip_checksum_byte(folder / "train-000001.tar", "s00030.cls")
    if not indexed:
        drop_index(folder)
    url = bucket.upload(folder, "data")
    with caplog.at_level(logging.WARNING):
        got, dataset = epoch(url)
    assert_costs_exactly(keys, got, dataset, {"s00000", "s00030"}, caplog)
    ranks = [epoch(url, distributed=shards.Distributed(rank, 3))[0] for rank in range(3)]  # slices that start mid-shard
    assert set(keys) - {key for got in ranks for key in got} == {"s00000", "s00030"}
    with pytest.raises(CorruptDataError) as info:
        epoch(url, errors=shards.ErrorPolicy("raise"))
    assert info.value.key == "s00000"


# -- HDF5 -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("at, lost", [(0, {"s00000"}), (20, {"s00019", "s00020"}), (SAMPLES, {"s00039"})],
                         ids=["first-offset", "middle-offset", "last-offset"])
def test_an_hdf5_offset_past_the_data_costs_the_samples_it_bounds(tmp_path, at, lost, caplog):
    folder = tmp_path / "data"
    keys = write_dataset(folder, storage="hdf5")
    with h5py.File(folder / "train-000000.h5", "r+") as f:
        f["offsets"][at] = f["offsets"][at] | (1 << 40)  # one high bit set
    with caplog.at_level(logging.WARNING):
        got, dataset = epoch(folder)
    assert_costs_exactly(keys, got, dataset, lost, caplog)
    with pytest.raises(CorruptDataError, match="corrupt HDF5 shard") as info:
        epoch(folder, errors=shards.ErrorPolicy("raise"))
    assert info.value.key == min(lost)


# -- labels ---------------------------------------------------------------------------------------------------------
def test_a_flipped_cls_bit_is_corrupt_data_naming_the_key(tmp_path, caplog):
    folder = tmp_path / "data"
    keys = write_dataset(folder)
    flip_label_bit(folder / "train-000000.tar", "s00012", 0x08)  # label 0 -> 8, of 3 classes
    with pytest.raises(CorruptDataError, match=r"train-000000.tar \[sample s00012\]: label 8 is outside \[0, 3\)"):
        epoch(folder, errors=shards.ErrorPolicy("raise"))
    with caplog.at_level(logging.WARNING):
        got, dataset = epoch(folder)
    assert_costs_exactly(keys, got, dataset, {"s00012"}, caplog)
    assert got == order_with_stand_ins(keys, "s00012")


def test_a_label_of_a_class_the_shard_has_none_of_is_corrupt(tmp_path, caplog):
    folder = tmp_path / "data"
    keys = write_dataset(folder, label_of=lambda n: n % 2)  # classes a and b only: c counts 0 in the shard
    flip_label_bit(folder / "train-000000.tar", "s00010", 0x02)  # 0 -> 2: in range, but not in this shard
    with pytest.raises(CorruptDataError, match=r"\[sample s00010\]: label 2 is a class the manifest counts no"):
        epoch(folder, errors=shards.ErrorPolicy("raise"))
    with caplog.at_level(logging.WARNING):
        got, dataset = epoch(folder)
    assert_costs_exactly(keys, got, dataset, {"s00010"}, caplog)


def test_an_hdf5_label_out_of_range_is_corrupt_data_naming_the_key(tmp_path, caplog):
    folder = tmp_path / "data"
    keys = write_dataset(folder, storage="hdf5")
    with h5py.File(folder / "train-000000.h5", "r+") as f:
        f["labels"][7] = 77
    with pytest.raises(CorruptDataError, match=r"train-000000.h5 \[sample s00007\]: label 77 is outside \[0, 3\)"):
        epoch(folder, errors=shards.ErrorPolicy("raise"))
    with caplog.at_level(logging.WARNING):
        got, dataset = epoch(folder)
    assert_costs_exactly(keys, got, dataset, {"s00007"}, caplog)


def test_verify_names_a_label_out_of_range(tmp_path):
    from shards.check.verify import verify_dataset

    folder = tmp_path / "data"
    write_dataset(folder)
    shard = folder / "train-000000.tar"
    flip_label_bit(shard, "s00012", 0x08)
    rewrite(folder, shard.name, shard.read_bytes())  # sha256 recorded again: only the label check can tell
    assert "train-000000.tar [sample s00012]: label 8 is outside [0, 3)" in verify_dataset(folder).problems
