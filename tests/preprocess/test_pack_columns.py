"""The column index as packing writes it: equal to the source index row for row (per split, with skipped files,
after ``--append`` and ``--overwrite``), nothing under a final name from a killed merge, and a merge whose memory
does not grow with the number of samples."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import pytest

import shards.formats.column_writer as columns_module
from preprocess.pack.append import append
from preprocess.pack.packer import PackConfig, pack_manifest
from preprocess.pack.merge import merge_parts
from preprocess.pack.parts import STATE_DIR
from shards.check.verify import verify_dataset
from shards.formats.columns import COLUMNS_KEY
from shards.select.columns import open_columns
from shards.manifest import load_dataset_manifest
from tests.helpers import class_image, write_image_folder
from tests.preprocess.corpus import BROKEN_KINDS, write_mixed_tree
from tests.s3.conftest import bucket, s3_env, s3_server  # noqa: F401 - the s3 test's fixtures

CLASSES = ["ant", "bee", "cat"]


def _index_rows(out: Path, manifest) -> list[dict]:
    path = out / manifest.extra["source_index"]["path"]
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def assert_columns_match_index(out: Path) -> None:
    """Every split's columns hold its source-index rows in manifest order (shards in order, rows by position)."""
    manifest = load_dataset_manifest(out)
    rows = _index_rows(out, manifest)
    assert set(manifest.extra[COLUMNS_KEY]["splits"]) == set(manifest.splits)
    for split, info in manifest.splits.items():
        order = {s.path: i for i, s in enumerate(info.shards)}
        mine = sorted((r for r in rows if r["split"] == split and r.get("shard")),
                      key=lambda r: (order[r["shard"]], r["row"]))
        columns = open_columns(out, manifest, split)
        assert columns.rows == info.samples == len(mine)
        assert [k.decode() for k in columns.column("key")] == [r["key"] for r in mine]
        assert columns.column("label").tolist() == [r["label"] for r in mine]
        assert columns.fields[:2] == ("key", "label") and "class" not in columns.fields
        for name in columns.fields[2:]:
            values = columns.column(name).tolist()
            present = columns.present(name)
            for i, row in enumerate(mine):
                if present is not None and not present[i]:
                    assert name not in row["meta"]
                    continue
                value = row["meta"][name]
                assert values[i] == (value.encode() if isinstance(value, str) else value), (split, name, i)
    assert verify_dataset(out, quiet=True).problems == ()


def test_pack_writes_each_splits_columns_equal_to_its_source_index(tmp_path):
    write_image_folder(tmp_path / "src", CLASSES, 8, size=(32, 24))
    out = tmp_path / "out"
    manifest = pack_manifest(PackConfig(str(tmp_path / "src"), str(out), max_samples=5, val_fraction=0.25, seed=3,
                                        quiet=True))
    assert set(manifest.splits) == {"train", "val"}
    entry = manifest.extra[COLUMNS_KEY]
    assert entry == load_dataset_manifest(out).extra[COLUMNS_KEY] and entry["format"] == "npy-1"
    assert set(entry["splits"]["train"]["fields"]) == {"key", "label", "path", "width", "height", "mode", "format"}
    assert_columns_match_index(out)


def test_skipped_files_have_no_row(tmp_path):
    made = write_mixed_tree(tmp_path / "src")
    out = tmp_path / "out"
    manifest = pack_manifest(PackConfig(str(tmp_path / "src"), str(out), max_samples=4, quiet=True))
    assert_columns_match_index(out)
    paths = {p.decode() for p in open_columns(out, manifest, "train").column("path")}
    assert paths == {p for p, kind in made.items() if kind not in BROKEN_KINDS}


def test_append_and_prune_rebuild_the_changed_splits_columns(tmp_path):
    src = tmp_path / "src"
    write_image_folder(src, CLASSES, 6, size=(24, 24))
    cfg = PackConfig(str(src), str(tmp_path / "out"), max_samples=4, val_fraction=0.25, seed=5, quiet=True)
    out = Path(cfg.out)
    before = pack_manifest(cfg).extra[COLUMNS_KEY]
    for i in range(5):
        (src / "bee" / f"new_{i:03d}.jpg").write_bytes(class_image(1, 1000 + i, (24, 24)))
    append(cfg)
    assert_columns_match_index(out)
    after = load_dataset_manifest(out).extra[COLUMNS_KEY]
    old_files = {f["path"] for s in before["splits"].values() for f in s["fields"].values()}
    new_files = {f["path"] for s in after["splits"].values() for f in s["fields"].values()}
    on_disk = {p.relative_to(out).as_posix() for p in (out / "columns").rglob("*")if p.is_file()}
    assert on_disk == new_files and not old_files & new_files - {  # changed splits got new numbers
        f["path"] for split, s in before["splits"].items() if s == after["splits"][split]
        for f in s["fields"].values()}
    first = sorted(src.rglob("*.jpg"))[0]
    first.unlink()
    append(cfg, prune=True)
    assert_columns_match_index(out)
    assert first.relative_to(src).as_posix().encode() not in {
        p for split in load_dataset_manifest(out).splits
        for p in open_columns(out, load_dataset_manifest(out), split).column("path")}


def test_a_dataset_packed_without_columns_gets_them_on_append(tmp_path):
    src = tmp_path / "src"
    write_image_folder(src, CLASSES, 4, size=(24, 24))
    cfg = PackConfig(str(src), str(tmp_path / "out"), max_samples=4, val_fraction=0.25, seed=5, quiet=True)
    out = Path(cfg.out)
    manifest = pack_manifest(cfg)
    shutil.rmtree(out / "columns")
    data = manifest.to_dict()
    del data[COLUMNS_KEY]
    (out / "dataset.json").write_text(json.dumps(data))
    assert open_columns(out, load_dataset_manifest(out), "train") is None
    append(cfg)  # nothing new: the index is still built
    assert_columns_match_index(out)


def test_overwrite_removes_the_old_column_files_and_nothing_else(tmp_path):
    write_image_folder(tmp_path / "src", CLASSES, 6, size=(24, 24))
    out = tmp_path / "out"
    pack_manifest(PackConfig(str(tmp_path / "src"), str(out), max_samples=3, val_fraction=0.3, quiet=True))
    (out / "columns" / "notes.txt").write_text("mine")
    (out / "columns" / "train" / "c900.npy").write_bytes(b"not named by the manifest")
    pack_manifest(PackConfig(str(tmp_path / "src"), str(out), max_samples=12, overwrite=True, quiet=True))
    assert_columns_match_index(out)
    assert (out / "columns" / "notes.txt").read_text() == "mine"
    assert (out / "columns" / "train" / "c900.npy").read_bytes() == b"not named by the manifest"
    assert not (out / "columns" / "val").exists()  # the old split's files were named, then its folder empty


def test_a_killed_merge_leaves_no_column_file_under_a_final_name(tmp_path, monkeypatch):
    write_image_folder(tmp_path / "src", CLASSES, 4, size=(24, 24))
    out = tmp_path / "out"
    pack_manifest(PackConfig(str(tmp_path / "src"), str(out), max_samples=3, quiet=True))
    shutil.rmtree(out / "columns")
    (out / "dataset.json").unlink()
    finished = []
    real_finish = columns_module._Column.finish

    def finish_then_die(column):
        if finished:
            raise KeyboardInterrupt  # killed between two files of one split
        finished.append(column)
        return real_finish(column)

    monkeypatch.setattr(columns_module._Column, "finish", finish_then_die)
    with pytest.raises(KeyboardInterrupt):
        merge_parts(out)
    assert not (out / "dataset.json").exists()
    assert [p.name for p in (out / "columns").rglob("*") if p.is_file()] == []
    monkeypatch.undo()
    merge_parts(out)
    assert_columns_match_index(out)


def _synthetic(out: Path, shards: int, per_shard: int, template: Path) -> None:
    """A packed-but-unmerged dataset of ``shards`` part manifests with ``per_shard`` index rows each (every shard
    file a copy of one real shard: the merge checks only its size)."""
    plan = json.loads((template / STATE_DIR / "plan.json").read_text())
    part = json.loads((template / STATE_DIR / "train-000000.tar.json").read_text())
    info = {k: v for k, v in part["shard"].items() if k not in ("index", "index_sha256")}
    (out / STATE_DIR).mkdir(parents=True)
    plan["shards"] = [{"name": f"train-{s:06d}.tar", "split": "train"} for s in range(shards)]
    plan["splits"] = ["train"]
    (out / STATE_DIR / "plan.json").write_text(json.dumps(plan))
    for s in range(shards):
        name = f"train-{s:06d}.tar"
        shutil.copyfile(template / "train-000000.tar", out / name)
        rows = [{"key": f"k{s}-{i}", "label": i % 3, "split": "train", "shard": name, "row": i, "size": 1000,
                 "mtime_ns": 1, "path": f"cls/{s}-{i}.jpg",
                 "meta": {"path": f"cls/{s}-{i}.jpg", "class": "ant", "width": 64, "height": 64 + i % 7,
                          "mode": "RGB", "format": "JPEG"}} for i in range(per_shard)]
        counts = [sum(1 for r in rows if r["label"] == c) for c in range(3)]
        (out / STATE_DIR / f"{name}.json").write_text(json.dumps(
            {**part, "index": rows, "skipped": [], "class_counts": counts,
             "shard": {**info, "path": name, "samples": per_shard, "class_counts": counts}}))


def _merge_peak(out: Path) -> int:
    tracemalloc.start()
    try:
        merge_parts(out)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_merge_memory_does_not_grow_with_the_number_of_samples(tmp_path, monkeypatch):
    monkeypatch.setattr(columns_module, "CHUNK_ROWS", 256)  # both sizes span many chunks
    write_image_folder(tmp_path / "src", CLASSES, 2, size=(16, 16))
    template = tmp_path / "template"
    pack_manifest(PackConfig(str(tmp_path / "src"), str(template), max_samples=3, quiet=True))
    small, large = tmp_path / "small", tmp_path / "large"
    _synthetic(small, 4, 300, template)
    _synthetic(large, 24, 300, template)  # 6x the samples, each shard (part) the same size
    peaks = [_merge_peak(small), _merge_peak(large)]
    assert load_dataset_manifest(large).splits["train"].samples == 7200
    assert open_columns(large, load_dataset_manifest(large), "train").column("key")[-1] == b"k23-299"
    # One part's rows and one chunk at a time: the 20 more shard entries cost a few kB each, where holding the
    # 6000 more rows (as the merge once did) costs over 6 MB.
    assert peaks[1] - peaks[0] < 1 << 20, peaks


@pytest.mark.s3
@pytest.mark.slow  # starting SeaweedFS takes seconds
def test_pack_to_s3_publishes_the_column_files_and_they_read_back(tmp_path, bucket, s3_env):
    from click.testing import CliRunner

    from preprocess.pack.cli import pack_shards_command
    from shards.transport.location import locate
    from shards.transport.manifest_io import load_manifest_at

    write_image_folder(tmp_path / "src", CLASSES, 4, size=(24, 24))
    stage = tmp_path / "stage"
    result = CliRunner().invoke(pack_shards_command, [str(tmp_path / "src"), "--out", bucket.url("ds"),
                                                      "--stage-dir", str(stage), "--val-fraction", "0.25", "--quiet"])
    assert result.exit_code == 0, result.output
    options = {"endpoint_url": s3_env.endpoint_url}
    manifest, base = load_manifest_at(bucket.url("ds"), storage_options=options)
    for split in manifest.splits:
        remote = open_columns(locate(base, storage_options=options), manifest, split)
        local = open_columns(stage, manifest, split)
        for name in local.fields:
            assert remote.column(name).tolist() == local.column(name).tolist()
    assert verify_dataset(bucket.url("ds"), storage_options=options, quiet=True).problems == ()
    key = f"{bucket.prefix}/ds/{manifest.extra[COLUMNS_KEY]['splits']['train']['fields']['width']['path']}"
    bucket.client.put_object(Bucket=bucket.name, Key=key, Body=b"\x93NUMPY garbage")
    problems = verify_dataset(bucket.url("ds"), storage_options=options, quiet=True).problems
    assert len(problems) == 1 and "columns/train/c" in problems[0], problems


_KILLED_MERGE = """
import os, sys, time
import shards.formats.column_writer as columns
from preprocess.pack.merge import merge_parts

real = columns._Column.write
def write_then_wait(column, rows, metas):
    real(column, rows, metas)
    if column.final.name == "c003.npy":
        open(sys.argv[2], "w").close()  # the parent kills this process now, mid-split
        time.sleep(60)
columns._Column.write = write_then_wait
merge_parts(sys.argv[1])
"""


def test_a_merge_killed_by_a_signal_leaves_temp_files_only_and_reruns_cleanly(tmp_path):
    import subprocess
    import sys
    import time

    write_image_folder(tmp_path / "src", CLASSES, 4, size=(24, 24))
    out = tmp_path / "out"
    pack_manifest(PackConfig(str(tmp_path / "src"), str(out), max_samples=3, quiet=True))
    shutil.rmtree(out / "columns")
    (out / "dataset.json").unlink()
    flag = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_MERGE, str(out), str(flag)],
                            cwd=Path(__file__).resolve().parents[2])
    deadline = time.monotonic() + 60
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert flag.exists()
    left = [p.name for p in (out / "columns").rglob("*") if p.is_file()]
    assert left and all(name.endswith(".tmp") for name in left)  # temp names only, never c000.npy
    assert not (out / "dataset.json").exists()
    merge_parts(out)  # the rerun removes what the killed one left
    assert not [p for p in (out / "columns").rglob("*.tmp")]
    assert_columns_match_index(out)
