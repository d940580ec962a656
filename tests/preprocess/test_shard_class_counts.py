"""Per-shard ``class_counts`` in the manifests, and each sample's metadata in the source index: what a class or
size subset needs to skip whole shards without reading them."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from preprocess.features.featurize import FeatureConfig, precompute_features
from preprocess.pack.append import append
from preprocess.pack.packer import PackConfig, pack, pack_manifest
from preprocess.pack.parts import INDEX_FILE
from preprocess.pack.table.pack import pack_table
from preprocess.pack.table.config import TableConfig
from shards.errors import ManifestError
from shards.formats.features import load_feature_shard
from shards.transport.storage import get_storage
from shards.manifest import DatasetManifest, load_dataset_manifest, load_feature_manifest
from tests.helpers import class_image, write_image_folder

CLASSES = ["ant", "bee", "cat"]
SIZE = (32, 24)


@pytest.fixture
def tree(tmp_path):
    return write_image_folder(tmp_path / "src", CLASSES, 7, size=SIZE)


def _config(tree: Path, out: Path, **overrides) -> PackConfig:
    return PackConfig(str(tree), str(out), **{"max_samples": 4, "val_fraction": 0.25, "seed": 2, "quiet": True,
                                              **overrides})


def _labels_in(out: Path, manifest: DatasetManifest, shard_path: str) -> list[int]:
    return [raw.label for raw in get_storage(manifest.storage).read(out / shard_path)]


def assert_counts_match_shards(out: Path, manifest: DatasetManifest) -> None:
    """Every shard's counts are the labels it really holds, and a split's shards add up to the split's counts."""
    for split in manifest.splits.values():
        for shard in split.shards:
            held = Counter(_labels_in(out, manifest, shard.path))
            assert shard.class_counts == tuple(held[i] for i in range(len(manifest.classes))), shard.path
        assert tuple(map(sum, zip(*(s.class_counts for s in split.shards)))) == split.class_counts


@pytest.mark.parametrize("storage", ["tar", "hdf5"])
def test_every_packed_shard_records_the_labels_it_holds(tree, tmp_path, storage):
    out = tmp_path / "out"
    manifest = pack_manifest(_config(tree, out, storage=storage))
    assert sum(len(s.shards) for s in manifest.splits.values()) > 2
    assert_counts_match_shards(out, manifest)
    data = json.loads((out / "dataset.json").read_text())
    shard = data["splits"]["train"]["shards"][0]
    assert isinstance(shard["class_counts"], list) and len(shard["class_counts"]) == len(CLASSES)
    assert load_dataset_manifest(out) == manifest


def test_a_task_array_merge_records_them_as_one_run_does(tree, tmp_path):
    single = pack_manifest(_config(tree, tmp_path / "single"))
    out = tmp_path / "array"
    assert pack(_config(tree, out, num_tasks=2, task_index=1)).manifest is None
    merged = pack(_config(tree, out, num_tasks=2, task_index=0)).manifest
    assert merged is not None
    assert_counts_match_shards(out, merged)
    assert merged.to_dict()["splits"] == single.to_dict()["splits"]


def test_appended_and_pruned_shards_record_them_too(tree, tmp_path):
    cfg = _config(tree, tmp_path / "out")
    before = pack_manifest(cfg)
    for i in range(5):
        (tree / "bee" / f"new_{i}.jpg").write_bytes(class_image(1, 500 + i, SIZE))
    appended = append(cfg).manifest
    new = {s.path for split in appended.splits.values() for s in split.shards} - \
          {s.path for split in before.splits.values() for s in split.shards}
    assert new and all(s.class_counts is not None for split in appended.splits.values() for s in split.shards)
    assert_counts_match_shards(Path(cfg.out), appended)
    (tree / "ant" / "img_0000.jpg").unlink()
    pruned = append(cfg, prune=True).manifest
    assert pruned.packing["appends"][-1]["replaced"]
    assert_counts_match_shards(Path(cfg.out), pruned)


def test_source_index_rows_carry_the_sample_metadata(tree, tmp_path):
    (tree / "cat" / "broken.jpg").write_bytes(b"not an image")
    cfg = _config(tree, tmp_path / "out")
    manifest = pack_manifest(cfg)
    out = Path(cfg.out)
    rows = {row["path"]: row for row in map(json.loads, (out / INDEX_FILE).read_text().splitlines())}
    assert "meta" not in rows["cat/broken.jpg"] and rows["cat/broken.jpg"]["shard"] is None
    members = {json.loads(raw.meta)["path"]: json.loads(raw.meta) for split in manifest.splits.values()
               for shard in split.shards for raw in get_storage(manifest.storage).read(out / shard.path)}
    packed = {path: row for path, row in rows.items() if row["shard"] is not None}
    assert {path: row["meta"] for path, row in packed.items()} == members
    assert all((row["meta"]["width"], row["meta"]["height"]) == SIZE for row in packed.values())

    (tree / "ant" / "wide.jpg").write_bytes(class_image(0, 900, (50, 20)))
    manifest = append(cfg).manifest  # the appended index keeps the old rows' meta and has the new row's
    rows = {row["path"]: row for row in map(json.loads, (out / manifest.extra["source_index"]["path"]).read_text()
                                            .splitlines())}
    assert (rows["ant/wide.jpg"]["meta"]["width"], rows["ant/wide.jpg"]["meta"]["height"]) == (50, 20)
    assert rows["ant/img_0003.jpg"]["meta"] == members["ant/img_0003.jpg"]
    assert append(cfg).summary["new_files"] == 0  # change detection is unaffected by the new key


@pytest.mark.slow  # over half a second in the quick loop
def test_features_json_shards_carry_the_image_shards_counts(tree, tmp_path):
    data_dir = tmp_path / "out"
    dataset = pack_manifest(_config(tree, data_dir))
    features = precompute_features(FeatureConfig(data_dir=data_dir, out_dir=tmp_path / "feat", backbone="resnet18",
                                                 weights="none", resize=40, crop=32, batch_size=8, workers=0,
                                                 quiet=True))
    assert features is not None and load_feature_manifest(tmp_path / "feat") == features
    for name, split in features.splits.items():
        assert [s.class_counts for s in split.shards] == [s.class_counts for s in dataset.splits[name].shards]
        for info in split.shards:
            labels = load_feature_shard(tmp_path / "feat" / info.path).labels.tolist()
            assert tuple(labels.count(i) for i in range(len(CLASSES))) == info.class_counts


def _write_csv(path: Path, target_of) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["x", "y", "target"])
        writer.writerows([i, (i * 7) % 5, target_of(i)] for i in range(30))
    return path


def test_classification_tables_record_shard_counts_and_regression_tables_do_not(tmp_path):
    csv_path = _write_csv(tmp_path / "classes.csv", lambda i: "abc"[i % 3])
    manifest = pack_table(TableConfig(str(csv_path), str(tmp_path / "classes"), target="target",
                                      max_samples=7)).manifest
    for split in manifest.splits.values():
        for info in split.shards:
            labels = load_feature_shard(tmp_path / "classes" / info.path).labels.tolist()
            assert info.class_counts == tuple(labels.count(i) for i in range(len(manifest.classes)))
        assert tuple(map(sum, zip(*(s.class_counts for s in split.shards)))) == split.class_counts
    assert load_feature_manifest(tmp_path / "classes") == manifest

    csv_path = _write_csv(tmp_path / "values.csv", lambda i: f"{i * 0.37:.2f}")
    manifest = pack_table(TableConfig(str(csv_path), str(tmp_path / "values"), target="target",
                                      task="regression")).manifest
    assert all(s.class_counts is None for split in manifest.splits.values() for s in split.shards)
    data = json.loads((tmp_path / "values" / "features.json").read_text())
    assert all("class_counts" not in s for split in data["splits"].values() for s in split["shards"])


def _rewrite_first_shard(out: Path, change) -> None:
    path = out / "dataset.json"
    data = json.loads(path.read_text())
    change(data["splits"]["train"]["shards"][0])
    path.write_text(json.dumps(data))


def test_a_manifest_without_shard_counts_loads_as_before(tree, tmp_path):
    out = tmp_path / "out"
    pack_manifest(_config(tree, out))
    _rewrite_first_shard(out, lambda shard: shard.pop("class_counts"))
    manifest = load_dataset_manifest(out)
    assert manifest.splits["train"].shards[0].class_counts is None
    assert "class_counts" not in manifest.splits["train"].shards[0].to_dict()
    assert manifest.splits["train"].shards[1].class_counts is not None


@pytest.mark.parametrize("value", ["3", [1, -1, 3], [1.0, 2, 1], [True, 3], {"ant": 4}, [0, 0, 1]])
def test_malformed_shard_counts_are_one_line_manifest_errors(tree, tmp_path, value):
    out = tmp_path / "out"
    pack_manifest(_config(tree, out))
    _rewrite_first_shard(out, lambda shard: shard.update(class_counts=value))
    with pytest.raises(ManifestError, match="class_counts") as caught:
        load_dataset_manifest(out)
    assert "\n" not in str(caught.value) and "dataset.json" in str(caught.value)
