"""``train-from-shards`` with the node-local shard cache: per-epoch counters in metrics.jsonl, and node affinity
chosen exactly when a node's cache cannot hold the train split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shards.manifest import load_dataset_manifest
from train.cli import train_command
from tests.train.configs import train_config
from train.data import affinity_nodes
from train.distributed import DistContext
from shards.runrecord import read_rows


@pytest.mark.slow
def test_metrics_count_fetches_and_hits_per_epoch(image_folder: Path, tmp_path: Path):
    result = CliRunner().invoke(train_command, [
        str(image_folder), "--out", str(tmp_path / "run"), "--model", "resnet18", "--image-size", "32",
        "--epochs", "2", "--batch-size", "8", "--workers", "1", "--device", "cpu", "--quiet",
        "--cache-dir", str(tmp_path / "node"), "--cache-local"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    first, second = [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")]
    shard_bytes = sum(p.stat().st_size for p in image_folder.glob("*.tar"))
    assert first["fetched_bytes"] == shard_bytes and first["cache"]["misses"] == 4  # 3 train + 1 val shards
    assert second["fetched_bytes"] == 0 and second["cache_hit_rate"] == 1.0
    assert summary["cache_hit_rate"] == 1.0 and summary["fetched_bytes"] == 0


def test_cache_options_need_a_folder(image_folder: Path, tmp_path: Path, monkeypatch):
    monkeypatch.delenv("SHARDCACHE_CACHE_DIR", raising=False)
    result = CliRunner().invoke(train_command, [str(image_folder), "--out", str(tmp_path / "run"),
                                                "--cache-limit", "1G", "--quiet"])
    assert result.exit_code == 2 and "--cache-dir" in result.output


def test_affinity_only_with_several_nodes_and_a_cache_smaller_than_the_split(image_folder: Path, tmp_path: Path):
    manifest = load_dataset_manifest(image_folder)
    split_bytes = sum(s.bytes for s in manifest.splits["train"].shards)

    def nodes(world: int, local: int, **cache) -> int | None:
        cfg = train_config(str(image_folder), str(tmp_path / "run"), **cache)
        return affinity_nodes(cfg, manifest, DistContext(0, world, 0, torch.device("cpu"), False, local))

    small = {"dir": str(tmp_path / "c"), "limit": split_bytes // 2}
    assert nodes(4, 2, **small) == 2
    assert nodes(4, 4, **small) is None  # one node: nothing to keep apart
    assert nodes(4, 2, dir=str(tmp_path / "c"), limit=split_bytes) is None  # the split fits
    assert nodes(4, 2, dir=str(tmp_path / "c")) is None  # no limit: everything fits
    assert nodes(4, 2) is None
