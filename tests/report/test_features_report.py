"""The feature-cache section: what the features are, and whether they are still the features of their dataset."""

from __future__ import annotations

import shutil

from shards.manifest import SplitInfo, load_dataset_manifest, load_feature_manifest
from shards.report.build import build_report, make_report
from tests.report.page import external_references, http_mentions, parse, tiles


def test_fresh_cache_shows_its_backbone_dtype_and_links_its_dataset(feature_dir):
    manifest = load_feature_manifest(feature_dir)
    report = make_report([feature_dir])
    assert [s.kind for s in report.sections] == ["features", "dataset"]  # the dataset it names comes along
    html = report.html()
    page = parse(html)
    assert page.unbalanced == [] and external_references(html) == [] and http_mentions(html) == []
    assert "Fresh: computed from the current dataset.json" in page.text
    details = page.key_values("backbone")
    assert details["backbone"] == "generated" and details["dtype"] == "float16"
    assert details["feature dim"] == "16" and details["dataset.json sha256"] == manifest.dataset_sha256
    assert details["weights sha256"] == "not recorded"
    assert [row[:3] for row in page.table("split", "samples", "feature shards")] == [
        [name, f"{split.samples:,}", str(len(split.shards))] for name, split in manifest.splits.items()]
    assert tiles(html)["cache"] == "fresh"
    dataset_anchor = report.sections[1].anchor
    assert f"#{dataset_anchor}" in page.references and dataset_anchor in page.ids


def test_changed_dataset_makes_the_cache_stale_and_says_why(feature_dir):
    dataset_dir = feature_dir.parent / "dataset"
    dataset = load_dataset_manifest(dataset_dir)
    dataset.replace(packing={"seed": 1}).save(dataset_dir)  # repacked with another seed
    html = build_report([feature_dir], grid=False)
    assert tiles(html)["cache"] == "stale"
    text = parse(html).text
    assert "Stale: the dataset changed" in text
    assert "dataset.json changed since the features were computed" in text


def test_a_removed_image_shard_is_named_as_a_reason(feature_dir):
    dataset_dir = feature_dir.parent / "dataset"
    dataset = load_dataset_manifest(dataset_dir)
    val = dataset.splits["val"]
    dataset.replace(splits={"train": dataset.splits["train"],
                            "val": SplitInfo(0, val.class_counts, ())}).save(dataset_dir)
    text = parse(build_report([feature_dir], grid=False)).text
    assert "source shard val-000000.tar is no longer in the dataset" in text


def test_a_missing_dataset_leaves_freshness_unknown(feature_dir):
    shutil.rmtree(feature_dir.parent / "dataset")
    report = make_report([feature_dir])
    assert [s.kind for s in report.sections] == ["features"]
    html = report.html()
    assert tiles(html)["cache"] == "unknown"
    text = parse(html).text
    assert "Freshness unknown" in text and "is gone" in text


def test_a_table_packed_cache_is_fresh_with_no_dataset_behind_it(tmp_path):
    import csv

    from preprocess.pack.table.pack import pack_table
    from preprocess.pack.table.config import TableConfig

    source = tmp_path / "t.csv"
    with open(source, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["x", "label"])
        writer.writerows([[str(i), str(i % 2)] for i in range(20)])
    pack_table(TableConfig(str(source), str(tmp_path / "feat"), target="label"))
    html = build_report([tmp_path / "feat"])
    assert tiles(html)["cache"] == "fresh"
    text = parse(html).text
    assert "packed from a table" in text and "Freshness unknown" not in text
