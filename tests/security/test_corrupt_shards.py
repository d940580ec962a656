"""Damaged or forged shard bytes, as an attacker or a bad disk would make them: every one is a ``CorruptDataError``
naming the shard and the key (or the header's byte offset), handled by ``on_error``; the CLI prints one line."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

import shards
from shards.atomic import sha256_file
from shards.check.features_verify import verify_feature_folder
from shards.errors import ChecksumError, CorruptDataError
from shards.formats.tar import iter_tar_shard
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset, write_labelled_shards
from tests.train.conftest import write_feature_folder
from train.cli import train_command


# -- forging helpers ------------------------------------------------------------------------------------------------
def header_offsets(shard: Path) -> dict[str, int]:
    """Member name -> byte offset of its header (the writer's ustar shards have no extended headers)."""
    with tarfile.open(shard) as tar:
        return {member.name: member.offset for member in tar.getmembers()}


def reseal(header: bytearray) -> bytearray:
    """Recompute a header's checksum, as a forger would, so only the field under test is wrong."""
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return header


def rewrite(folder: Path, name: str, data: bytes, manifest: str = "dataset.json") -> None:
    """Replace a shard and record its new size and sha256, so only the content check can catch it."""
    (folder / name).write_bytes(data)
    path = folder / manifest
    document = json.loads(path.read_text())
    for split in document["splits"].values():
        for shard in split["shards"]:
            if shard["path"] == name:
                shard["bytes"], shard["sha256"] = len(data), sha256_file(folder / name)
    path.write_text(json.dumps(document))


def forge_header(folder: Path, shard: str, member: str, edit) -> int:
    path = folder / shard
    data = bytearray(path.read_bytes())
    offset = header_offsets(path)[member]
    header = bytearray(data[offset:offset + 512])
    edit(header)
    data[offset:offset + 512] = header
    rewrite(folder, shard, bytes(data))
    return offset


def keys_of(dataset) -> list[str]:
    return [key for _, _, key in dataset]


# -- tar headers ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flipped", [b"9", b"x", b"1"], ids=["non-octal-digit", "letter", "wrong-digit"])
def test_flipped_checksum_byte_names_shard_key_and_offset(tmp_path, flipped):
    write_labelled_shards(tmp_path, [[0, 1, 2], [0, 1, 2]])
    path = tmp_path / "train-000001.tar"
    data = bytearray(path.read_bytes())
    offset = header_offsets(path)["s00004.jpg"]
    position = offset + 150
    data[position:position + 1] = flipped if data[position:position + 1] != flipped else b"2"
    path.write_bytes(bytes(data))  # a flipped byte on disk: the manifest still has the old sha256
    with pytest.raises(CorruptDataError) as info:
        list(shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False)))
    message = str(info.value)
    assert "train-000001.tar" in message and f"byte {offset}" in message and "\n" not in message
    assert info.value.key == "s00004"

    skipping = shards.open_dataset(tmp_path, errors=shards.ErrorPolicy("skip"), return_keys=True,
                                   sampling=shards.Sampling(shuffle=False))
    got = keys_of(skipping)
    assert len(got) == 6 and skipping.skipped == 1  # s00004 only: reading resyncs at the next sample
    assert set(got) == {"s00000", "s00001", "s00002", "s00003", "s00005"}


def test_flipped_checksum_in_a_worker_is_skipped_too(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1, 2], [0, 1, 2]])
    forge_header(tmp_path, "train-000000.tar", "s00001.cls", lambda h: h.__setitem__(slice(150, 151), b"8"))
    dataset = shards.open_dataset(tmp_path, errors=shards.ErrorPolicy("skip"), transform="eval")
    loader = shards.make_loader(dataset, batch_size=2, mode=WorkerProcesses(2, persistent=False), drop_last=False)
    assert sum(len(labels) for _, labels in loader) == 6
    assert dataset.skipped == 1  # s00001 only: reading resyncs at the next sample


@pytest.mark.parametrize("size_field", [b"77777777777\0", b"\x80" + (1 << 80).to_bytes(11, "big"),
                                        b"\xff" * 12], ids=["8GB-octal", "base256-2^80", "negative"])
def test_huge_member_size_is_refused_before_reading(tmp_path, size_field):
    write_labelled_shards(tmp_path, [[0, 1, 2]])
    offset = forge_header(tmp_path, "train-000000.tar", "s00001.jpg",
                          lambda h: reseal(h.__setitem__(slice(124, 136), size_field) or h))
    with pytest.raises(CorruptDataError) as info:
        list(shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False)))
    assert f"byte {offset}" in str(info.value) and "train-000000.tar" in str(info.value)
    with pytest.raises(CorruptDataError, match=f"byte {offset}"):
        list(iter_tar_shard(tmp_path / "train-000000.tar"))  # what shards verify and featurize read with


@pytest.mark.parametrize("member, field, garbage, message", [
    ("s00002.cls", slice(124, 136), b"0000000z001\0", "size"),  # a size that is not octal
    ("s00001.json", slice(0, 4), b"\xff\xfe\xfd\xfc", "UTF-8"),  # a name that is not UTF-8
])
def test_malformed_header_fields_are_corrupt_data(tmp_path, member, field, garbage, message):
    write_labelled_shards(tmp_path, [[0, 1, 2]])
    offset = forge_header(tmp_path, "train-000000.tar", member,
                          lambda h: reseal(h.__setitem__(field, garbage) or h))
    with pytest.raises(CorruptDataError, match=f"train-000000.tar.*byte {offset}.*{message}"):
        list(shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False)))


def test_a_bad_header_mid_shard_is_skipped_and_counted(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1, 2]])
    forge_header(tmp_path, "train-000000.tar", "s00002.cls",
                 lambda h: reseal(h.__setitem__(slice(124, 136), b"0000000z001\0") or h))
    skipping = shards.open_dataset(tmp_path, errors=shards.ErrorPolicy("skip"), return_keys=True,
                                   sampling=shards.Sampling(shuffle=False))
    assert keys_of(skipping) == ["s00000", "s00001", "s00001"] and skipping.skipped == 1


def pax_header(payload: bytes) -> bytes:
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = len(payload)
    return info.tobuf(tarfile.USTAR_FORMAT) + payload + bytes(-len(payload) % 512)


@pytest.mark.parametrize("payload", [b"this is not a pax record\n", b"99 path=x\n", b"12 path=\xff\xfe\n"],
                         ids=["garbage", "length-past-end", "not-utf8"])
def test_malformed_pax_header_is_corrupt_data(tmp_path, payload):
    write_labelled_shards(tmp_path, [[0, 1, 2]])
    path = tmp_path / "train-000000.tar"
    data = path.read_bytes()
    offset = header_offsets(path)["s00001.jpg"]
    rewrite(tmp_path, path.name, data[:offset] + pax_header(payload) + data[offset:])
    # Charged to the sample whose members follow the damaged header.
    with pytest.raises(CorruptDataError, match=rf"train-000000.tar \[sample s00001\]: bad tar header at byte {offset}"):
        list(shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False)))


def test_valid_pax_path_still_names_the_member(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1]])
    path = tmp_path / "train-000000.tar"
    data = path.read_bytes()
    offset = header_offsets(path)["s00001.jpg"]
    record = b"path=s00001.jpg\n"
    record = b"%d %s" % (len(record) + 3, record)
    rewrite(tmp_path, path.name, data[:offset] + pax_header(record) + data[offset:])
    in_order = shards.Sampling(shuffle=False)
    assert keys_of(shards.open_dataset(tmp_path, return_keys=True, sampling=in_order)) == ["s00000", "s00001"]


def test_truncated_tar_names_the_member_and_offset(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1, 2], [0, 1, 2]])
    path = tmp_path / "train-000001.tar"
    offset = header_offsets(path)["s00004.jpg"]
    rewrite(tmp_path, path.name, path.read_bytes()[:offset + 700])  # the header and part of the image
    with pytest.raises(CorruptDataError) as info:
        list(shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False)))
    assert info.value.key == "s00004" and f"byte {offset}" in str(info.value)
    skipping = shards.open_dataset(tmp_path, errors=shards.ErrorPolicy("skip"), sampling=shards.Sampling(shuffle=False))
    assert len(list(skipping)) == 6 and skipping.skipped == 2


def test_flipped_image_byte_fails_the_whole_shard_checksum(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1, 2]])
    path = tmp_path / "train-000000.tar"
    data = bytearray(path.read_bytes())
    data[header_offsets(path)["s00001.jpg"] + 512 + 300] ^= 0x04  # decodes fine, trains on wrong pixels
    path.write_bytes(bytes(data))
    in_order = shards.Sampling(shuffle=False)
    assert len(list(shards.open_dataset(tmp_path, sampling=in_order))) == 3  # not hashed by default (README)
    dataset = shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False))
    dataset.verify_sha256 = True
    with pytest.raises(ChecksumError, match="train-000000.tar: sha256"):
        list(dataset)
    # A slice that starts mid-shard (another rank) is never hashed: its samples read, nothing else is claimed.
    dataset = shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False),
                                  distributed=shards.Distributed(world_size=3, rank=1))
    dataset.verify_sha256 = True
    assert len(list(dataset)) == 1


# -- HDF5 -----------------------------------------------------------------------------------------------------------
def test_hdf5_with_garbage_bytes_names_the_shard(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1, 2]], storage="hdf5")
    path = tmp_path / "train-000000.h5"
    data = bytearray(path.read_bytes())
    data[:64] = bytes(range(64))  # the superblock
    rewrite(tmp_path, path.name, bytes(data))
    with pytest.raises(CorruptDataError, match="train-000000.h5: unreadable HDF5"):
        list(shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False)))


@pytest.mark.parametrize("forgery", ["keys-not-text", "offsets-decreasing", "labels-short", "data-bomb"])
def test_forged_hdf5_layout_names_the_shard(tmp_path, forgery):
    write_labelled_shards(tmp_path, [[0, 1, 2]], storage="hdf5")
    path = tmp_path / "train-000000.h5"
    with h5py.File(path, "r+") as f:
        if forgery == "keys-not-text":
            del f["key_ends"]
            f["key_ends"] = np.arange(3.0)
        elif forgery == "offsets-decreasing":
            f["offsets"][2] = 1
        elif forgery == "labels-short":
            del f["labels"]
            f["labels"] = np.zeros(2, dtype=np.int64)
        else:  # an unwritten chunked dataset: tiny on disk, 8 GB when read
            del f["data"]
            f.create_dataset("data", shape=(1 << 33,), dtype=np.uint8, chunks=(1 << 20,), compression="gzip")
            f["offsets"][3] = 1 << 33
    rewrite(tmp_path, path.name, path.read_bytes())
    with pytest.raises(CorruptDataError, match=r"train-000000.h5( \[sample s\d+\])?: (corrupt|unreadable) HDF5 shard"):
        list(shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False)))


# -- feature shards -------------------------------------------------------------------------------------------------
def resave(path: Path, **changes) -> None:
    """Load a ``.pt`` feature shard, change entries and save it again (a valid file, wrong content)."""
    data = torch.load(path, weights_only=True)
    for name, change in changes.items():
        data[name] = change(data[name])
    torch.save(data, path)


def with_label(row: int, value: int):
    def change(labels: torch.Tensor) -> torch.Tensor:
        labels = labels.clone()
        labels[row] = value
        return labels
    return change


def consume(folder: Path, batched: bool) -> None:
    dataset = shards.open_dataset(folder, sampling=shards.Sampling(shuffle=False))
    if batched:
        list(shards.make_loader(dataset, batch_size=4))
    else:
        list(dataset)


@pytest.mark.parametrize("batched", [False, True], ids=["per-sample", "batches"])
def test_flipped_label_bit_fails_the_sha256(tmp_path, batched):
    write_feature_dataset(tmp_path, [5, 4])
    resave(tmp_path / "train-000000.pt", labels=with_label(2, 2 | (1 << 46)))  # 70368744177666
    with pytest.raises(ChecksumError, match="train-000000.pt: .*features.json"):
        consume(tmp_path, batched)


@pytest.mark.parametrize("batched", [False, True], ids=["per-sample", "batches"])
def test_label_out_of_range_is_caught_even_with_a_matching_manifest(tmp_path, batched):
    write_feature_dataset(tmp_path, [5, 4])
    path = tmp_path / "train-000001.pt"
    resave(path, labels=with_label(1, 70368744177666))
    rewrite(tmp_path, path.name, path.read_bytes(), "features.json")
    with pytest.raises(CorruptDataError, match=r"train-000001.pt: label 70368744177666 at row 1 \(key f00006\)"):
        consume(tmp_path, batched)


def test_flipped_feature_value_bit_fails_the_sha256(tmp_path):
    write_feature_dataset(tmp_path, [5, 4])
    path = tmp_path / "train-000000.pt"
    values = torch.load(path, weights_only=True)["features"].numpy().tobytes()
    data = bytearray(path.read_bytes())
    at = bytes(data).index(values) + 7
    data[at] ^= 0x40  # still a valid file, one value changed
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="train-000000.pt"):
        consume(tmp_path, batched=True)


@pytest.mark.parametrize("change", ["dim", "dtype", "labels-dtype", "keys"])
def test_feature_shapes_must_match_the_manifest(tmp_path, change):
    write_feature_dataset(tmp_path, [5, 4], dim=4)
    path = tmp_path / "train-000000.pt"
    edits = {"dim": {"features": lambda f: torch.cat([f, f[:, :1]], dim=1)},
             "dtype": {"features": lambda f: f.float()},
             "labels-dtype": {"labels": lambda labels: labels.to(torch.int32)},
             "keys": {"keys": lambda keys: keys[:-1]}}[change]
    resave(path, **edits)
    rewrite(tmp_path, path.name, path.read_bytes(), "features.json")
    with pytest.raises(CorruptDataError, match="train-000000.pt: "):
        consume(tmp_path, batched=True)


def test_verify_loads_every_feature_file_and_checks_labels_and_keys(tmp_path):
    features = write_feature_folder(tmp_path, shard_sizes={"train": [6, 5]}, classes=("a", "b", "c"), dim=8)
    path = features / "train-000001.pt"
    resave(path, labels=with_label(3, -1), keys=lambda keys: [keys[0]] + keys[:-1])
    rewrite(features, path.name, path.read_bytes(), "features.json")
    problems = verify_feature_folder(features)  # checksums match: only loading the file finds these
    assert any("train-000001.pt: label -1 at row 3" in problem for problem in problems), problems
    assert any("train-000001.pt" in problem and "duplicate key" in problem for problem in problems), problems


# -- the command line -----------------------------------------------------------------------------------------------
def assert_one_line_data_error(result, *fragments: str) -> None:
    assert isinstance(result.exception, SystemExit), result.exception  # not an uncaught exception
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("workers", [0, 1])
def test_train_on_a_corrupt_tar_prints_one_line(tmp_path, workers):
    folder = tmp_path / "images"
    make_shard_dataset(folder, classes=("r", "g", "b"), shard_sizes={"train": [8, 8], "val": [6]}, size=(32, 32))
    for shard in ("train-000000.tar", "train-000001.tar"):
        forge_header(folder, shard, next(iter(header_offsets(folder / shard))),
                     lambda h: h.__setitem__(slice(150, 151), b"9"))
    result = CliRunner().invoke(train_command, [
        str(folder), "--out", str(tmp_path / "run"), "--quiet", "--device", "cpu", "--model", "mobilenet_v3_small",
        "--image-size", "32", "--epochs", "1", "--batch-size", "4", "--workers", str(workers)])
    assert_one_line_data_error(result, "bad tar header at byte 0")


def test_train_on_a_corrupt_feature_shard_prints_one_line(tmp_path):
    features = write_feature_folder(tmp_path, shard_sizes={"train": [20, 12], "val": [8]}, classes=("a", "b", "c"))
    resave(features / "train-000001.pt", labels=with_label(2, 2 | (1 << 46)))
    result = CliRunner().invoke(train_command, [str(features), "--out", str(tmp_path / "run"), "--quiet",
                                                "--device", "cpu", "--epochs", "1", "--batch-size", "4"])
    assert_one_line_data_error(result, "train-000001.pt", "features.json records")
