"""Round 4 (issue 42): an adopted dataset never serves a sample under another's label when its tars change under
the index, and ``shards index`` reads only what lies inside its source and writes only inside ``--out``."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

import shards
from preprocess.adopt.index import index_tars
from shards.errors import ChecksumError, CorruptDataError, InputError
from shards.formats.adopted import checked_rows
from shards.manifest import load_dataset_manifest
from tests.helpers import serve_folder

wds = pytest.importorskip("webdataset")

SKIP = shards.ErrorPolicy(on_error="skip", max_consecutive_errors=100)
IMAGE_BYTES = 600  # every image the same size: a swap keeps the tar's layout


def raw(sample, seed):
    return sample.data


def image(i: int) -> bytes:
    return random.Random(i).randbytes(IMAGE_BYTES)


def write_tar(path: Path, first: int, count: int, *, meta=None) -> None:
    with wds.TarWriter(str(path)) as writer:
        for i in range(first, first + count):
            sample = {"__key__": f"s{i:04d}", "jpg": image(i), "cls": i % 3}
            if meta is not None:
                sample["json"] = meta(i)
            writer.write(sample)


def served(index: Path, base: str, **options) -> tuple[list[tuple[str, bytes, int]], object]:
    dataset = shards.open_dataset(index, "train", remote=shards.Remote(base_url=base), return_keys=True,
                                  decode=shards.Decode(decoder=raw), sampling=shards.Sampling(shuffle=False),
                                  **options)
    items = [(key, bytes(data), int(label)) for data, label, key in dataset]
    return items, dataset


@pytest.fixture
def adopted(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_tar(src / "a-000.tar", 0, 6)
    write_tar(src / "b-001.tar", 6, 6)
    index_tars(str(src), str(tmp_path / "index"), label_member="cls", quiet=True)
    truth, _ = served(tmp_path / "index", str(src))
    return src, tmp_path / "index", set(truth)


def swap_images(tar: Path, first: int, second: int, *, whole_members: bool = False) -> None:
    """Swap the image data (or the whole members, headers too) of samples ``first`` and ``second``."""
    data = bytearray(tar.read_bytes())
    spans = []
    for i in (first, second):
        start = data.index(image(i))
        if whole_members:
            header = data.rindex(f"s{i:04d}.jpg".encode(), 0, start)
            spans.append((header, start + IMAGE_BYTES))  # the header block starts at the member's name
        else:
            spans.append((start, start + IMAGE_BYTES))
    (a0, a1), (b0, b1) = spans
    data[a0:a1], data[b0:b1] = bytes(data[b0:b1]), bytes(data[a0:a1])
    stat = tar.stat()
    tar.write_bytes(bytes(data))
    os.utime(tar, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the mtime restored: nothing but the bytes says so


@pytest.mark.parametrize("whole_members", [False, True])
def test_swapped_equal_size_images_are_never_served_under_another_label(adopted, whole_members):
    src, index, truth = adopted
    swap_images(src / "a-000.tar", 1, 4, whole_members=whole_members)
    items, dataset = served(index, str(src), errors=SKIP)
    assert set(items) <= truth  # every pair served is one the index recorded
    assert {"s0001", "s0004"}.isdisjoint(key for key, _, _ in items)
    assert dataset.skipped == 2 and len(items) == 12
    with pytest.raises(CorruptDataError, match=r"a-000\.tar.*s0001.*row 1.*changed since it was indexed"):
        served(index, str(src))


def test_a_tar_replaced_by_another_of_its_size_is_named_as_changed(adopted, tmp_path):
    src, index, truth = adopted
    write_tar(tmp_path / "other.tar", 100, 6)
    assert (tmp_path / "other.tar").stat().st_size == (src / "b-001.tar").stat().st_size
    os.replace(tmp_path / "other.tar", src / "b-001.tar")
    items, dataset = served(index, str(src), errors=SKIP)
    assert set(items) <= truth and dataset.skipped == 6  # the replaced tar's rows: none served
    from shards.formats.adopted import iter_adopted_slice, load_rows
    from shards.transport.location import locate

    info = load_dataset_manifest(index).splits["train"].shards[1]
    rows = load_rows(locate(str(index)), info)
    with pytest.raises(CorruptDataError, match=r"b-001\.tar.*changed since it was indexed: the first 3 rows.*"
                                               r"shards index"):
        list(iter_adopted_slice(src / "b-001.tar", offsets=rows, resync=True))


def test_incremental_index_detects_a_same_size_change_with_its_mtime_restored(adopted):
    src, index, _ = adopted
    committed = (index / "dataset.json").read_bytes()
    swap_images(src / "a-000.tar", 0, 2)
    with pytest.raises(ChecksumError, match=r"a-000\.tar.*changed since it was indexed"):
        index_tars(str(src), str(index), label_member="cls", quiet=True)
    assert (index / "dataset.json").read_bytes() == committed


@pytest.mark.slow
def test_over_http_a_swapped_tar_serves_no_wrong_pairing(adopted):
    src, index, truth = adopted
    swap_images(src / "a-000.tar", 1, 4)
    with serve_folder(src) as url:
        items, dataset = served(index, url, errors=SKIP)
    assert set(items) <= truth and dataset.skipped == 2


def test_row_index_keys_are_bounded_by_the_manifest(adopted):
    _, index, _ = adopted
    info = load_dataset_manifest(index).splits["train"].shards[0]
    data = bytearray((index / info.index).read_bytes())
    data[16:24] = (1 << 62).to_bytes(8, "little")  # keys claimed: far more than MAX_KEY_BYTES per row
    with pytest.raises(CorruptDataError, match="bad row index"):  # refused by the bound, before any allocation
        checked_rows(bytes(data), "x.rows", info)


def test_index_refuses_entries_resolving_outside_the_source(tmp_path):
    src, outside = tmp_path / "src", tmp_path / "outside"
    src.mkdir()
    outside.mkdir()
    write_tar(src / "a-000.tar", 0, 3)
    write_tar(outside / "elsewhere.tar", 50, 3)
    secret = outside / "secret"
    secret.write_bytes(b"TOP-SECRET-BYTES" * 64)
    (src / "zz.tar").symlink_to(secret)
    (src / "yy.tar").symlink_to(outside / "elsewhere.tar")
    (src / "linked").symlink_to(outside, target_is_directory=True)
    report = index_tars(str(src), str(tmp_path / "index"), label_member="cls", quiet=True)
    assert report.indexed == ("a-000.tar",) and report.samples == {"train": 3}
    manifest = (tmp_path / "index" / "dataset.json").read_text()
    skipped = {s["path"]: s["reason"] for s in json.loads(manifest)["source"]["skipped"]}
    assert {"zz.tar", "yy.tar"} <= set(skipped) and "outside" in skipped["zz.tar"]
    assert "TOP-SECRET" not in manifest and "elsewhere" not in manifest and "s0050" not in manifest


@pytest.mark.parametrize("planted", [".adopt", "part"])
def test_a_planted_symlink_in_the_index_never_carries_writes_outside_out(tmp_path, planted):
    src, outside, out = tmp_path / "src", tmp_path / "outside", tmp_path / "index"
    (src / "part").mkdir(parents=True)
    outside.mkdir()
    out.mkdir()
    write_tar(src / "part" / "a-000.tar", 0, 3)
    (out / planted).symlink_to(outside, target_is_directory=True)
    with pytest.raises(InputError, match=rf"{planted}.*symbolic link"):
        index_tars(str(src), str(out), label_member="cls", quiet=True)
    assert list(outside.iterdir()) == []


def test_json_columns_are_bounded_in_distinct_fields_and_fields_per_sample(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    write_tar(src / "a-000.tar", 0, 4, meta=lambda i: {f"f{i}_{n}": n for n in range(2500)})  # 10,000 distinct
    started = time.monotonic()
    index_tars(str(src), str(tmp_path / "index"), label_member="cls", quiet=True)
    assert time.monotonic() - started < 5
    files = [p for p in (tmp_path / "index").rglob("*") if p.is_file()]
    assert len(files) < 200
    manifest = json.loads((tmp_path / "index" / "dataset.json").read_text())
    assert manifest["adoption"]["json_fields_dropped"] == 4 * (2500 - 32)  # past 32 a sample
    entry = manifest["columns"]["splits"]["train"]
    assert len(entry["fields"]) == 2 + 64 and entry["dropped"] == {"fields": 64, "values": 64, "names": [
        f"f2_{n}" for n in sorted(map(str, range(32)))][:8]}  # the first 64 distinct kept (samples 0, 1)
    assert (tmp_path / "index" / "dataset.json").stat().st_size < 100_000
