"""``shards export-index``: a wids shard index that webdataset's own random-access reader (``wids``) opens, giving
the samples of the split, key by key and byte for byte, in manifest order; refusals in one line, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import wids
from click.testing import CliRunner

from shards.cli.main import main as shards_main
from shards.formats.tar import iter_tar_shard
from shards.manifest import load_dataset_manifest
from shards.publish.wids_index import export_wids_index
from tests.helpers import make_shard_dataset

SIZES = {"train": [3, 2, 4], "val": [2]}


def dataset(folder: Path, storage: str = "tar") -> Path:
    make_shard_dataset(folder, shard_sizes=SIZES, storage=storage, size=(8, 8))
    return folder


def ours(folder: Path, split: str) -> list[tuple[str, dict[str, bytes]]]:
    """The split's samples as our reader reads them, members named as wids names them (``.ext``)."""
    out = []
    for shard in load_dataset_manifest(folder).splits[split].shards:
        for sample in iter_tar_shard(folder / shard.path):
            out.append((sample.key, {f".{sample.ext}": sample.data, ".cls": str(sample.label).encode(),
                                     ".json": sample.meta}))
    return out


def through_wids(index: Path, cache: Path) -> list[tuple[str, dict[str, bytes]]]:
    """Every sample wids gives for ``index``, in index order, undecoded (wids hands members over as ``BytesIO``;
    ``cache``: where it copies shards)."""
    reader = wids.ShardListDataset(str(index), cache_dir=str(cache), transformations=[])
    try:
        rows = [reader[i] for i in range(len(reader))]
    finally:
        reader.close()
    return [(row["__key__"], {k: v.getvalue() for k, v in row.items() if not k.startswith("__")}) for row in rows]


def export(*args: str):
    return CliRunner().invoke(shards_main, ["export-index", *args])


@pytest.mark.parametrize("split", ["train", "val"])
def test_wids_reads_every_sample_of_the_split_in_order(tmp_path, split):
    folder = dataset(tmp_path / "ds")
    index = tmp_path / "indexes" / f"{split}.json"
    result = export(str(folder), "--out", str(index), "--split", split)
    assert result.exit_code == 0, result.output
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert line["samples"] == sum(SIZES[split]) and line["shards"] == len(SIZES[split]) and line["relative_urls"]
    assert through_wids(index, tmp_path / "cache") == ours(folder, split)


def test_the_index_holds_relative_urls_counts_and_sizes(tmp_path):
    folder = dataset(tmp_path / "ds")
    export_wids_index(folder, "train", folder / "wids.json")
    index = json.loads((folder / "wids.json").read_text())
    shards = load_dataset_manifest(folder).splits["train"].shards
    assert index["__kind__"] == "wids-shard-index-v1" and index["wids_version"] == 1
    assert [(s["url"], s["nsamples"], s["filesize"]) for s in index["shardlist"]] == \
        [(s.path, s.samples, s.bytes) for s in shards]
    assert index["shardcache"]["classes"] == ["a", "b", "c"]


def test_a_moved_folder_still_opens(tmp_path):
    folder = dataset(tmp_path / "place" / "ds")
    export_wids_index(folder, "train", tmp_path / "place" / "index.json")
    expected = ours(folder, "train")
    moved = tmp_path / "elsewhere"
    shutil.move(tmp_path / "place", moved)
    assert not (tmp_path / "place").exists()
    assert through_wids(moved / "index.json", tmp_path / "cache") == expected


def test_url_base_prefixes_every_shard(tmp_path):
    folder = dataset(tmp_path / "ds")
    export_wids_index(folder, "train", tmp_path / "abs.json", url_base=str(folder))
    urls = [s["url"] for s in json.loads((tmp_path / "abs.json").read_text())["shardlist"]]
    assert urls == [f"{folder}/train-00000{i}.tar" for i in range(3)]
    assert through_wids(tmp_path / "abs.json", tmp_path / "cache") == ours(folder, "train")
    export_wids_index(folder, "train", tmp_path / "web.json", url_base="https://data.example/sets/ds/")
    urls = [s["url"] for s in json.loads((tmp_path / "web.json").read_text())["shardlist"]]
    assert urls == [f"https://data.example/sets/ds/train-00000{i}.tar" for i in range(3)]


def test_hdf5_is_refused_in_one_line(tmp_path):
    folder = dataset(tmp_path / "ds", storage="hdf5")
    result = export(str(folder), "--out", str(tmp_path / "i.json"))
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "wids reads tar shards only" in result.output
    assert not (tmp_path / "i.json").exists()


@pytest.mark.parametrize("storage, message", [("wds", "adopted WebDataset index"),
                                              ("zarr", "wids reads tar shards only")])
def test_other_storages_are_refused_by_what_they_are(tmp_path, storage, message):
    folder = dataset(tmp_path / "ds")
    manifest = json.loads((folder / "dataset.json").read_text())
    (folder / "dataset.json").write_text(json.dumps({**manifest, "storage": storage}))
    result = export(str(folder), "--out", str(tmp_path / "i.json"))
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "i.json").exists()


def test_an_existing_file_is_kept_without_overwrite(tmp_path):
    folder = dataset(tmp_path / "ds")
    index = tmp_path / "i.json"
    index.write_text("{}")
    result = export(str(folder), "--out", str(index))
    assert result.exit_code == 2 and "--overwrite" in result.output
    assert index.read_text() == "{}"


def test_overwrite_replaces_an_earlier_index_only(tmp_path):
    folder = dataset(tmp_path / "ds")
    index = tmp_path / "i.json"
    assert export(str(folder), "--out", str(index), "--split", "val").exit_code == 0
    assert export(str(folder), "--out", str(index), "--overwrite").exit_code == 0
    assert sum(s["nsamples"] for s in json.loads(index.read_text())["shardlist"]) == sum(SIZES["train"])
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "notes"}')
    result = export(str(folder), "--out", str(mine), "--overwrite")
    assert result.exit_code == 2 and "not a wids index" in result.output
    assert mine.read_text() == '{"my": "notes"}'


@pytest.mark.parametrize("out, message", [("dataset.json", "other than a manifest"), ("index.txt", ".json file"),
                                          ("s3://bucket/index.json", "not supported")])
def test_an_out_that_is_not_a_local_index_file_is_refused(tmp_path, out, message):
    folder = dataset(tmp_path / "ds")
    before = (folder / "dataset.json").read_bytes()
    target = out if out.startswith("s3:") else str(folder / out)
    result = export(str(folder), "--out", target)
    assert result.exit_code == 2 and message in result.output
    assert (folder / "dataset.json").read_bytes() == before and not (folder / "index.txt").exists()


def test_a_missing_split_names_the_ones_there(tmp_path):
    folder = dataset(tmp_path / "ds")
    result = export(str(folder), "--out", str(tmp_path / "i.json"), "--split", "test")
    assert result.exit_code == 2
    assert "no split 'test'" in result.output and "train" in result.output
    assert not (tmp_path / "i.json").exists()


@pytest.mark.parametrize("name, why", [("it's.tar", "quote"), ("part#1.tar", "'#'"), ("a;b.tar", "';'")])
def test_a_shard_name_wids_would_misread_is_refused(tmp_path, name, why):
    folder = dataset(tmp_path / "ds")
    manifest = json.loads((folder / "dataset.json").read_text())
    shard = manifest["splits"]["train"]["shards"][1]
    (folder / shard["path"]).rename(folder / name)
    shard["path"] = name
    (folder / "dataset.json").write_text(json.dumps(manifest))
    result = export(str(folder), "--out", str(tmp_path / "i.json"))
    assert result.exit_code == 2 and name in result.output and why in result.output
    assert not (tmp_path / "i.json").exists()


def test_a_missing_shard_is_named(tmp_path):
    folder = dataset(tmp_path / "ds")
    (folder / "train-000001.tar").unlink()
    result = export(str(folder), "--out", str(tmp_path / "i.json"))
    assert result.exit_code == 2 and "train-000001.tar" in result.output and "missing" in result.output
    assert not (tmp_path / "i.json").exists()
