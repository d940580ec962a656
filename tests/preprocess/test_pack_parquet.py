"""pack-shards from Parquet files, Hub-layout folders and ``datasets.save_to_disk`` folders (real pyarrow files)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import shards  # noqa: E402
from preprocess.pack.append import append_shards  # noqa: E402
from preprocess.pack.cli import pack_shards_command  # noqa: E402
from preprocess.pack.sources.members import SourceFields  # noqa: E402
from preprocess.pack.packer import PackConfig, pack_manifest  # noqa: E402
from preprocess.pack.plan import make_plan  # noqa: E402
from preprocess.pack.sources.scan import scan_source  # noqa: E402
from shards.errors import InputError  # noqa: E402
from shards.manifest import load_dataset_manifest  # noqa: E402
from shards.formats.tar import iter_tar_shard  # noqa: E402
from shards.select.mixture import SourceSpec, Subset  # noqa: E402
from tests.helpers import class_image  # noqa: E402

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
NAMES = ["zebra", "ant", "cat"]  # ClassLabel order, deliberately unsorted


def hf_metadata(names=NAMES) -> dict:
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": list(names)}}
    return {b"huggingface": json.dumps({"info": {"features": features}}).encode()}


def hub_file(path: Path, rows: int, *, first: int = 0, metadata=True, row_group_size: int = 3) -> None:
    """A Hub-style Parquet file: HF Image structs, ClassLabel ints, two scalar columns and a nested one."""
    table = pa.table({
        "image": pa.array([{"bytes": class_image(i % 3, first + i, size=(20, 16)), "path": f"img{i}.jpg"}
                           for i in range(rows)], IMAGE),
        "label": pa.array([i % 3 for i in range(rows)], pa.int64()),
        "score": [float(first + i) for i in range(rows)],
        "caption": [f"row {first + i}" for i in range(rows)],
        "boxes": pa.array([[1, 2]] * rows, pa.list_(pa.int32())),
    })
    if metadata:
        table = table.replace_schema_metadata(hf_metadata())
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)


def hub_folder(root: Path) -> Path:
    hub_file(root / "data" / "train-00000-of-00002.parquet", 7)
    hub_file(root / "data" / "train-00001-of-00002.parquet", 5, first=7)
    hub_file(root / "data" / "validation-00000-of-00001.parquet", 4, first=100)
    return root


def pack(source, out, **options):
    return pack_manifest(PackConfig(source=str(source), out=str(out), quiet=True, **options))


def packed_samples(out: Path) -> dict[str, tuple[int, bytes, dict]]:
    found = {}
    for split in json.loads((out / "dataset.json").read_text())["splits"].values():
        for shard in split["shards"]:
            for raw in iter_tar_shard(out / shard["path"]):
                found[raw.key] = (raw.label, raw.data, json.loads(raw.meta))
    return found


def shard_digests(out: Path) -> dict[str, str]:
    manifest = json.loads((out / "dataset.json").read_text())
    return {s["path"]: s["sha256"] for split in manifest["splits"].values() for s in split["shards"]}


def test_hub_folder_keeps_splits_class_names_and_scalar_columns(tmp_path):
    manifest = pack(hub_folder(tmp_path / "src"), tmp_path / "out", max_samples=4)
    assert manifest.classes == ("ant", "cat", "zebra")  # sorted, as every manifest's
    assert {name: split.samples for name, split in manifest.splits.items()} == {"train": 12, "val": 4}
    assert manifest.source.kind == "parquet"
    samples = packed_samples(tmp_path / "out")
    assert len(samples) == 16
    for label, data, meta in samples.values():
        row = int(meta["path"].rpartition("#")[2])
        first = 7 if "00001-of" in meta["path"] else 100 if "validation" in meta["path"] else 0
        assert meta["class"] == NAMES[row % 3] == manifest.classes[label]  # mapped by name, not by number
        assert data == class_image(row % 3, first + row, size=(20, 16))  # the cell's bytes, untouched
        assert (meta["score"], meta["caption"]) == (float(first + row), f"row {first + row}")
        assert "boxes" not in meta  # a nested column is not metadata
    key = "data_train-00001-of-00002_parquet_3-"
    assert sum(k.startswith(key) for k in samples) == 1  # derived from the file's name and the row
    wide = shards.open_dataset(SourceSpec(tmp_path / "out", subset=Subset(where="score >= 10 and score < 100")),
                               "train", return_keys=True, decode=shards.Decode(decoder=lambda data, ext: 0))
    assert sorted(samples[k][2]["score"] for _, _, k in wide) == [10.0, 11.0]


@pytest.mark.slow  # three packs, one with worker processes
def test_same_input_and_seed_give_identical_shards_and_keys_whatever_the_workers(tmp_path):
    src = hub_folder(tmp_path / "src")
    one = pack(src, tmp_path / "one", max_samples=3, seed=5)
    two = pack(src, tmp_path / "two", max_samples=3, seed=5, workers=2)
    assert shard_digests(tmp_path / "one") == shard_digests(tmp_path / "two")
    assert one.packing["plan_sha256"] == two.packing["plan_sha256"]
    pack(src, tmp_path / "other", max_samples=3, seed=6)
    assert shard_digests(tmp_path / "other") != shard_digests(tmp_path / "one")
    assert set(packed_samples(tmp_path / "other")) == set(packed_samples(tmp_path / "one"))


def test_a_killed_pack_reruns_to_the_same_result(tmp_path):
    src = hub_folder(tmp_path / "src")
    pack(src, tmp_path / "whole", max_samples=3)
    pack(src, tmp_path / "out", max_samples=3)
    # What a kill after some shards leaves: no dataset.json, a shard gone, another cut short.
    (tmp_path / "out" / "dataset.json").unlink()
    (tmp_path / "out" / "train-000001.tar").unlink()
    with open(tmp_path / "out" / "train-000002.tar", "r+b") as handle:
        handle.truncate(1024)
    pack(src, tmp_path / "out", max_samples=3)
    assert shard_digests(tmp_path / "out") == shard_digests(tmp_path / "whole")
    assert (tmp_path / "out" / "source-index.jsonl").read_bytes() == (
        tmp_path / "whole" / "source-index.jsonl").read_bytes()


def test_append_packs_only_the_rows_of_new_files(tmp_path):
    src = tmp_path / "src"
    hub_file(src / "data" / "train-00000-of-00002.parquet", 6)
    first = pack(src, tmp_path / "out", max_samples=4)
    hub_file(src / "data" / "train-00001-of-00002.parquet", 5, first=6)
    appended = pack_shards_append(src, tmp_path / "out")
    assert appended.splits["train"].samples == 11
    new = [s.path for s in appended.splits["train"].shards if s not in first.splits["train"].shards]
    rows = [json.loads(raw.meta)["path"] for name in new for raw in iter_tar_shard(tmp_path / "out" / name)]
    assert sorted(rows) == sorted(f"data/train-00001-of-00002.parquet#{i}" for i in range(5))


def pack_shards_append(source, out):
    return append_shards(PackConfig(source=str(source), out=str(out), quiet=True))


def test_binary_cells_string_labels_and_a_split_column(tmp_path):
    cells = [class_image(0, 0, size=(8, 8)), None, b"not an image", class_image(1, 1, size=(8, 8)),
             class_image(1, 2, size=(8, 8))]
    table = pa.table({"png": pa.array(cells, pa.binary()), "kind": ["dog", "dog", "cat", None, "cat"],
                      "split": ["train", "train", "train", "train", "test"]})
    pq.write_table(table, tmp_path / "table.parquet")
    fields = SourceFields(image_column="png", label_column="kind")
    scan = scan_source(tmp_path / "table.parquet", fields=fields)
    assert scan.classes == ("cat", "dog")
    assert {s.rel_path: s.reason for s in scan.skipped} == {"table.parquet#1": "image cell is empty (null)",
                                                           "table.parquet#3": "no label"}
    result = CliRunner().invoke(pack_shards_command, [str(tmp_path / "table.parquet"), "-o", str(tmp_path / "out"),
                                                      "--image-column", "png", "--label-column", "kind"])
    assert result.exit_code == 0, result.stderr
    manifest = load_dataset_manifest(tmp_path / "out")
    assert {name: split.samples for name, split in manifest.splits.items()} == {"train": 1, "test": 1}
    reasons = {s.path: s.reason for s in manifest.source.skipped}
    assert reasons["table.parquet#2"].startswith("not an image")  # the packer's own validation
    assert len(reasons) == 3


def test_a_path_only_struct_column_is_refused_and_a_path_only_cell_skipped(tmp_path):
    paths_only = pa.table({"image": pa.array([{"path": "/etc/passwd"}], pa.struct([("path", pa.string())])),
                           "label": [0]})
    pq.write_table(paths_only, tmp_path / "paths.parquet")
    with pytest.raises(InputError, match=r"paths\.parquet: row group 0, column 'image': .*only a path.*never follows"):
        scan_source(tmp_path / "paths.parquet")
    mixed = pa.table({"image": pa.array([{"bytes": None, "path": "/etc/passwd"},
                                         {"bytes": class_image(0, 0), "path": None}], IMAGE), "label": [0, 0]})
    pq.write_table(mixed, tmp_path / "mixed.parquet")
    scan = scan_source(tmp_path / "mixed.parquet")
    assert len(scan.samples) == 1
    assert "only a path" in scan.skipped[0].reason and "never followed" in scan.skipped[0].reason


@pytest.mark.parametrize("columns, message", [
    ({"picture": [b"x"], "label": [0]}, "column 'image': no such column"),
    ({"image": [b"x"], "y": [0]}, "column 'label': no such column"),
    ({"image": ["a.jpg"], "label": [0]}, "column 'image': type string holds no image bytes"),
    ({"image": [b"x"], "label": pa.array([[1]], pa.list_(pa.int64()))}, "column 'label': type list<element: int64> "
                                                                         "cannot be read as a label"),
])
def test_bad_columns_are_one_line_naming_file_row_group_and_column_exit_2(tmp_path, columns, message):
    pq.write_table(pa.table(columns), tmp_path / "bad.parquet")
    result = CliRunner().invoke(pack_shards_command, [str(tmp_path / "bad.parquet"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bad.parquet: row group 0, " + message in errors[0], result.stderr
    assert not (tmp_path / "out").exists()


def test_a_classlabel_index_out_of_range_names_its_row_group(tmp_path):
    table = pa.table({"image": [class_image(0, i) for i in range(4)], "label": [0, 1, 2, 3]})
    pq.write_table(table.replace_schema_metadata(hf_metadata()), tmp_path / "x.parquet", row_group_size=2)
    with pytest.raises(InputError, match=r"x\.parquet: row group 1, column 'label': label 3 is not one of the 3"):
        scan_source(tmp_path / "x.parquet")


def test_image_options_are_refused_for_image_folders(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_bytes(class_image(0, 0))
    with pytest.raises(InputError, match="apply to Parquet"):
        scan_source(tmp_path / "src", fields=SourceFields(image_column="img"))


@pytest.mark.slow  # imports the datasets library
def test_save_to_disk_folder_with_splits_and_classlabel(tmp_path):
    datasets = pytest.importorskip("datasets")

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES),
                                  "note": datasets.Value("string")})

    def split(n, first):
        images = [Image.open(io.BytesIO(class_image(i % 3, first + i, size=(12, 10)))) for i in range(n)]
        return datasets.Dataset.from_dict({"image": images, "label": [i % 3 for i in range(n)],
                                           "note": [f"n{first + i}" for i in range(n)]}, features=features)

    datasets.DatasetDict({"train": split(6, 0), "validation": split(3, 50)}).save_to_disk(str(tmp_path / "hf"))
    scan = scan_source(tmp_path / "hf")
    assert scan.kind == "hf-arrow" and scan.members.container == "arrow"
    manifest = pack(tmp_path / "hf", tmp_path / "out")
    assert manifest.classes == ("ant", "cat", "zebra")
    assert {name: s.samples for name, s in manifest.splits.items()} == {"train": 6, "val": 3}
    for label, _, meta in packed_samples(tmp_path / "out").values():
        row = int(meta["path"].rpartition("#")[2])
        assert manifest.classes[label] == NAMES[row % 3]
        assert meta["note"].startswith("n") and meta["format"] == "JPEG"
    single = tmp_path / "single"
    split(4, 0).save_to_disk(str(single))
    assert len(scan_source(single).samples) == 4


def test_a_fifo_named_like_a_parquet_file_is_refused_not_opened(tmp_path):
    hub_file(tmp_path / "src" / "data" / "train-00000-of-00001.parquet", 3)
    os.mkfifo(tmp_path / "src" / "data" / "train-00001-of-00001.parquet")  # opening it to read would block
    with pytest.raises(InputError, match=r"train-00001-of-00001\.parquet: not a regular file \(FIFO\)"):
        scan_source(tmp_path / "src")


def test_shuffle_keeps_row_groups_together_so_a_shard_reads_few(tmp_path):
    hub_file(tmp_path / "src" / "data" / "train-00000-of-00001.parquet", 60, row_group_size=6)  # 10 row groups
    scan = scan_source(tmp_path / "src")
    packing = {"seed": 1, "shuffle": True, "val_fraction": 0.0, "max_samples": 12, "max_bytes": 1 << 30}
    plan = make_plan(scan, packing, "tar")
    assert plan.sha256 == make_plan(scan_source(tmp_path / "src"), packing, "tar").sha256
    rows = [[s.offset for s in shard.samples] for shard in plan.shards]
    assert sorted(r for shard in rows for r in shard) == list(range(60))  # every row once
    assert all(len({r // 6 for r in shard}) <= 3 for shard in rows)  # 12 rows: at most 3 row groups each
    assert [r // 6 for shard in rows for r in shard] != sorted(r // 6 for shard in rows for r in shard)  # mixed
    assert any(shard != sorted(shard) for shard in rows)  # and shuffled within each shard
    other = make_plan(scan, {**packing, "seed": 2}, "tar")
    assert [[s.offset for s in shard.samples] for shard in other.shards] != rows


@pytest.mark.slow  # starts a Python
def test_without_pyarrow_a_parquet_source_is_refused_with_the_extra_named(tmp_path):
    hub_file(tmp_path / "x.parquet", 2)
    code = ("import sys; sys.modules['pyarrow'] = None\n"  # as if the parquet extra were not installed
            "from preprocess.pack.cli import pack_shards_command\n"
            f"pack_shards_command([{str(tmp_path / 'x.parquet')!r}, '-o', {str(tmp_path / 'out')!r}])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2, result.stderr
    assert "error: reading Parquet or Arrow files needs pyarrow (pip install 'shardcache[parquet]')" in result.stderr


def test_a_file_that_is_not_parquet_is_one_line_exit_2(tmp_path):
    (tmp_path / "src" / "data").mkdir(parents=True)
    (tmp_path / "src" / "data" / "train-00000-of-00001.parquet").write_bytes(b"PAR1 but not really" * 10)
    result = CliRunner().invoke(pack_shards_command, [str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "train-00000-of-00001.parquet: not a readable Parquet file (" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # starts a Python
def test_the_scan_reads_a_row_group_at_a_time_never_the_whole_table(tmp_path):
    cells = [os.urandom(100_000) for _ in range(10)]  # 1 MB a row group, 30 MB the file (the scan decodes none)
    table = pa.table({"image": pa.array(cells * 30, pa.binary()), "label": [i % 3 for i in range(300)]})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=10, compression="none")
    code = ("import pyarrow as pa; from preprocess.pack.sources.scan import scan_source\n"
            f"scan = scan_source({str(tmp_path / 'big.parquet')!r})\n"
            "print(len(scan.samples), pa.default_memory_pool().max_memory())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    rows, peak = map(int, result.stdout.split())
    assert rows == 300
    assert peak < 10_000_000, f"peak Arrow memory {peak} bytes: a few 1 MB row groups at most, not the 30 MB file"
