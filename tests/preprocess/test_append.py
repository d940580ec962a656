"""``pack-shards --append``: new files into new shards, packed shards never rewritten, changes reported or pruned."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from preprocess.pack.append import append, append_shards
from preprocess.pack.packer import PackConfig, pack
from shards.errors import InputError
from shards.manifest import load_dataset_manifest
from shards.transport.storage import get_storage
from tests.helpers import class_image, write_image_folder

CLASSES = ["a", "b", "c"]


def _config(tmp_path: Path, **overrides) -> PackConfig:
    options = {"source": str(tmp_path / "src"), "out": str(tmp_path / "out"), "max_samples": 4,
               "val_fraction": 0.25, "seed": 5, "quiet": True, **overrides}
    return PackConfig(**options)


def _packed(tmp_path: Path, per_class: int = 6, **overrides) -> PackConfig:
    write_image_folder(tmp_path / "src", CLASSES, per_class=per_class, size=(24, 24))
    cfg = _config(tmp_path, **overrides)
    pack(cfg)
    return cfg


def _add(tmp_path: Path, label: int, indices: range) -> None:
    for i in indices:
        (tmp_path / "src" / CLASSES[label] / f"new_{i:03d}.jpg").write_bytes(class_image(label, 1000 + i, (24, 24)))


def _stamps(out: Path, storage: str = "tar") -> dict[str, tuple[int, int]]:
    suffix = get_storage(storage).suffix
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob(f"*{suffix}")}


def _keys(out: Path) -> list[str]:
    manifest = load_dataset_manifest(out)
    read = get_storage(manifest.storage).read
    return [raw.key for split in manifest.splits.values() for shard in split.shards for raw in read(out / shard.path)]


def _total(out: Path) -> int:
    return sum(split.samples for split in load_dataset_manifest(out).splits.values())


@pytest.mark.parametrize("storage", ["tar", "hdf5"])
def test_new_files_go_into_new_shards_with_the_next_indices(tmp_path, storage):
    cfg = _packed(tmp_path, storage=storage)
    out = Path(cfg.out)
    before, shards_before = load_dataset_manifest(out), _stamps(out, storage)
    _add(tmp_path, 1, range(5))
    result = append(cfg)

    after = _stamps(out, storage)
    assert {name: after[name] for name in shards_before} == shards_before  # never rewritten
    new = sorted(set(after) - set(shards_before))
    assert new == sorted(result.summary["new_shards"]) and result.summary["new_files"] == 5
    last = {split: max(s.path for s in info.shards) for split, info in before.splits.items()}
    assert all(name > last[name.split("-")[0]] for name in new)
    manifest = load_dataset_manifest(out)
    assert _total(out) == 18 + 5 == len(set(_keys(out)))
    assert [sum(c) for c in zip(*(s.class_counts for s in manifest.splits.values()))] == [6, 11, 6]
    assert manifest.packing["appends"][-1]["new_files"] == 5


def test_nothing_new_leaves_the_manifest_byte_identical(tmp_path):
    cfg = _packed(tmp_path)
    manifest_bytes = (Path(cfg.out) / "dataset.json").read_bytes()
    result = append(cfg)
    assert result.summary["new_files"] == 0 and result.summary["shards_written"] == 0
    assert (Path(cfg.out) / "dataset.json").read_bytes() == manifest_bytes


def test_appending_uses_the_recorded_packing_options(tmp_path):
    cfg = _packed(tmp_path)
    _add(tmp_path, 0, range(9))
    append(_config(tmp_path, max_samples=1000, val_fraction=0.0))  # options given now do not apply
    manifest = load_dataset_manifest(Path(cfg.out))
    assert all(s.samples <= 4 for split in manifest.splits.values() for s in split.shards)
    assert manifest.splits["val"].class_counts[0] > 2  # the new files were split into train and val too


def test_changed_and_disappeared_files_are_reported_and_kept_until_pruned(tmp_path):
    cfg = _packed(tmp_path)
    out = Path(cfg.out)
    (tmp_path / "src" / "a" / "img_0001.jpg").unlink()
    changed = tmp_path / "src" / "c" / "img_0002.jpg"
    changed.write_bytes(class_image(2, 777, (30, 30)))
    report = append(cfg).summary
    assert (report["changed_files"], report["disappeared_files"], report["dropped_files"]) == (1, 1, 0)
    assert _total(out) == 18

    stamps = _stamps(out)
    pruned = append(cfg, prune=True)
    assert pruned.summary["dropped_files"] == 2
    assert _total(out) == 17  # one gone, the changed one packed again as its new version
    replaced = pruned.summary["replaced_shards"]
    assert replaced and all(old not in _stamps(out) for old in replaced)
    kept = {name: stamp for name, stamp in stamps.items() if name not in replaced}
    assert {name: _stamps(out)[name] for name in kept} == kept
    index_path = out / load_dataset_manifest(out).extra["source_index"]["path"]
    rows = {json.loads(line)["path"]: json.loads(line) for line in index_path.read_text().splitlines()}
    assert "a/img_0001.jpg" not in rows and rows["c/img_0002.jpg"]["size"] == changed.stat().st_size
    assert len(_keys(out)) == len(set(_keys(out))) == 17
    assert append(cfg, prune=True).summary["shards_written"] == 0


def test_a_run_killed_before_the_commit_is_redone_identically(tmp_path, monkeypatch):
    cfg = _packed(tmp_path)
    out = Path(cfg.out)
    _add(tmp_path, 2, range(3))
    manifest_bytes = (out / "dataset.json").read_bytes()
    monkeypatch.setattr("preprocess.pack.append.DatasetManifest.save", lambda self, folder: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        append(cfg)
    assert (out / "dataset.json").read_bytes() == manifest_bytes  # the old dataset is whole
    monkeypatch.undo()
    result = append(cfg)
    assert result.summary["new_files"] == 3 and _total(out) == 21
    assert len(set(_keys(out))) == 21


def test_append_refuses_a_new_class(tmp_path):
    cfg = _packed(tmp_path)
    write_image_folder(tmp_path / "src", ["zebra"], per_class=2, size=(24, 24))
    with pytest.raises(InputError, match="new class 'zebra'"):
        append_shards(cfg)


def test_append_without_a_dataset_packs_everything(tmp_path):
    write_image_folder(tmp_path / "src", CLASSES, per_class=3, size=(24, 24))
    manifest = append_shards(_config(tmp_path, val_fraction=0.0))
    assert sum(split.samples for split in manifest.splits.values()) == 9
    assert os.path.isfile(tmp_path / "out" / "dataset.json")


def test_cli_append_prints_what_it_packed_and_prune_needs_append(tmp_path):
    from click.testing import CliRunner

    from preprocess.pack.cli import pack_shards_command

    cfg = _packed(tmp_path)
    _add(tmp_path, 0, range(2))
    runner = CliRunner()
    result = runner.invoke(pack_shards_command, [cfg.source, "--out", cfg.out, "--append", "--quiet"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["new_files"] == 2 and summary["samples"] == 20
    refused = runner.invoke(pack_shards_command, [cfg.source, "--out", cfg.out, "--prune", "--quiet"])
    assert refused.exit_code == 2 and "--prune works only with --append" in refused.output


@pytest.mark.slow  # over half a second in the quick loop
def test_overwrite_removes_the_index_files_appends_wrote(tmp_path):
    cfg = _packed(tmp_path)
    out = Path(cfg.out)
    _add(tmp_path, 0, range(3))
    append_shards(cfg)
    appended = sorted(p.name for p in out.glob("source-index-*.jsonl"))
    assert appended, "the append should have written its own index file"
    (out / "notes.txt").write_text("mine")
    pack(_config(tmp_path, seed=6, overwrite=True))
    assert not list(out.glob("source-index-*.jsonl"))
    assert (out / "notes.txt").read_text() == "mine"
    assert _total(out) == 6 * 3 + 3


def test_after_append_and_prune_every_index_row_names_its_sample_position(tmp_path):
    # Subsets select rows by the source index's (shard, row) without reading shards: after a prune rewrote shards,
    # each row must still point at the sample with its key.
    cfg = _packed(tmp_path)
    out = Path(cfg.out)
    _add(tmp_path, 1, range(3))
    (tmp_path / "src" / "a" / "img_0001.jpg").unlink()
    append(cfg, prune=True)
    manifest = load_dataset_manifest(out)
    index_path = out / manifest.extra["source_index"]["path"]
    rows = [json.loads(line) for line in index_path.read_text().splitlines() if line.strip()]
    packed = [row for row in rows if row.get("shard")]
    assert len(packed) == sum(split.samples for split in manifest.splits.values()) == 20
    storage = get_storage(manifest.storage)
    keys_of = {info.path: [s.key for s in storage.read(out / info.path)]
               for split in manifest.splits.values() for info in split.shards}
    assert all(keys_of[row["shard"]][row["row"]] == row["key"] for row in packed)
