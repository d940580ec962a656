"""precompute-features reads through the training reader: features never depend on how rows reach the backbone,
every shard's bytes are checked against dataset.json before its features are written, and bad input is one line."""

from __future__ import annotations

import json
import random

import pytest
import torch
from click.testing import CliRunner

from preprocess.features.assembly import FeatureAssembly
from preprocess.features.cli import precompute_features_command
from preprocess.features.featurize import FeatureConfig, precompute_features
from preprocess.features.loader import ShardJob
from shards.check.features_verify import verify_feature_folder
from shards.manifest import ShardInfo
from tests.helpers import make_shard_dataset

SHARDS = {"train": [5, 3, 4], "val": [4]}
OPTIONS = ["--backbone", "resnet18", "--weights", "none", "--resize", "40", "--crop", "32", "--device", "cpu", "-q"]


def _jobs(sizes: list[int]) -> list[ShardJob]:
    return [ShardJob(i, "train", ShardInfo(f"train-{i:06d}.tar", n, 0, "0" * 64), f"/data/train-{i:06d}.tar")
            for i, n in enumerate(sizes)]


def _batch(rows: list[int]) -> dict:
    return {"rows": torch.tensor(rows), "labels": torch.tensor(rows) % 3, "keys": [f"k{r}" for r in rows],
            "image": torch.tensor(rows, dtype=torch.float32)[:, None]}


@pytest.mark.parametrize("seed", range(5))
def test_assembly_featurises_whole_chunks_from_each_shards_start_whatever_the_arrival_order(seed):
    """Rows arrive in loader batches cut across shards and from several workers (later rows first); the backbone
    sees exactly the chunks a shard read alone gives, and each shard comes out once, in order, when complete."""
    sizes, batch_size = [5, 3, 0, 9, 4], 2
    calls: list[tuple[int, list[int]]] = []

    def featurise(job, pieces):
        rows = [int(r) for p in pieces for r in p["rows"]]
        calls.append((job.index, rows))
        image = torch.cat([p["image"] for p in pieces]) if pieces else torch.empty(0, 1)
        return image * 10, None

    jobs = _jobs(sizes)
    assembly = FeatureAssembly(jobs, batch_size, featurise)
    done = {job.index: parts.shard() for job, parts in assembly.empty_shards()}
    assert list(done) == [2] and len(done[2]) == 0
    total = sum(sizes)
    cut = random.Random(seed).sample(range(1, total), 4)  # loader batches of any length, in any order
    edges = [0, *sorted(cut), total]
    batches = [list(range(a, b)) for a, b in zip(edges, edges[1:])]
    random.Random(seed).shuffle(batches)
    first = [0, 5, 8, 8, 17]
    for rows in batches:
        for job, parts in assembly.add(_batch(rows)):
            assert job.index not in done
            done[job.index] = parts.shard()
            assert sum(len(r) for j, r in calls if j == job.index) == sizes[job.index]  # not before its last row
    assert sorted(done) == list(range(len(sizes)))
    for index, shard in done.items():
        rows = list(range(first[index], first[index] + sizes[index]))
        assert shard.keys == [f"k{r}" for r in rows] and shard.labels.tolist() == [r % 3 for r in rows]
        assert shard.features[:, 0].tolist() == [10.0 * r for r in rows]
    for index, rows in calls:
        if sizes[index]:
            local = [r - first[index] for r in rows]
            assert local[0] % batch_size == 0 and local == list(range(local[0], local[0] + len(local)))
            assert len(local) == min(batch_size, sizes[index] - local[0])


@pytest.mark.slow
def test_features_are_the_same_bytes_whatever_the_workers_and_batch_size_cut(tmp_path):
    """Three workers and batches of 3 deal one shard's rows to two workers and cut chunks across loader batches:
    the files equal those of a run without workers."""
    data = tmp_path / "data"
    make_shard_dataset(data, shard_sizes={"train": [7, 2, 5], "val": [6]})
    base = dict(backbone="resnet18", weights="none", resize=40, crop=32, device="cpu", quiet=True, views=1,
                augment=True, batch_size=3)
    precompute_features(FeatureConfig(data, tmp_path / "plain", workers=0, **base))
    precompute_features(FeatureConfig(data, tmp_path / "workers", workers=3, **base))
    files = sorted(p.name for p in (tmp_path / "plain").glob("*.pt"))
    assert len(files) == 4
    assert all((tmp_path / "plain" / f).read_bytes() == (tmp_path / "workers" / f).read_bytes() for f in files)
    assert verify_feature_folder(tmp_path / "workers", full=True) == []


def _one_line(result, code: int, *fragments: str) -> str:
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(fragment in lines[0] for fragment in fragments), lines[0]
    return lines[0]


@pytest.mark.parametrize("cached", [False, True])
def test_a_shard_whose_bytes_differ_from_dataset_json_gets_no_features(tmp_path, cached):
    """Same size, one byte changed where no sample lies (the tar's end padding): every sample reads fine, and the
    shard is still refused, whether read from its folder or through a node-cache copy."""
    data = tmp_path / "data"
    make_shard_dataset(data, shard_sizes=SHARDS)
    shard = data / "train-000001.tar"
    payload = shard.read_bytes()
    shard.write_bytes(payload[:-1] + b"\x01")
    cache = ["--cache-dir", str(tmp_path / "node"), "--cache-local"] if cached else []
    result = CliRunner().invoke(precompute_features_command, [str(data), "--out", str(tmp_path / "feat"), *OPTIONS,
                                                              "--workers", "0", *cache])
    _one_line(result, 1, "train-000001.tar", "sha256")
    assert not (tmp_path / "feat" / "train-000001.pt").exists()
    assert not (tmp_path / "feat" / "features.json").exists()


@pytest.mark.parametrize("data_dir", ["https://example.invalid/data", "pipe:cat data.tar", "s3://-bucket/data"])
def test_a_dataset_features_json_could_not_name_is_refused_before_anything_is_read(tmp_path, data_dir):
    result = CliRunner().invoke(precompute_features_command, [data_dir, "--out", str(tmp_path / "feat"), *OPTIONS])
    _one_line(result, 2, repr(data_dir), "must be a local folder or an s3://bucket/prefix URL"
              if not data_dir.startswith("s3") else "is not an s3://bucket/prefix URL")
    assert not (tmp_path / "feat").exists()


def test_a_missing_shard_is_refused_before_anything_is_written(tmp_path):
    data = tmp_path / "data"
    make_shard_dataset(data, shard_sizes=SHARDS)
    (data / "val-000000.tar").unlink()
    result = CliRunner().invoke(precompute_features_command, [str(data), "--out", str(tmp_path / "feat"), *OPTIONS])
    _one_line(result, 2, "val-000000.tar", "missing")
    assert not (tmp_path / "feat").exists()


@pytest.mark.slow  # worker processes; test_featurize.py covers the in-process line
def test_an_undecodable_sample_read_by_a_worker_is_one_line_naming_shard_and_key(tmp_path):
    data = tmp_path / "data"
    make_shard_dataset(data, shard_sizes=SHARDS)
    shard = data / "train-000002.tar"
    payload = shard.read_bytes()
    start = payload.index(b"\xff\xd8\xff")  # the shard's first JPEG: sample train_00008
    shard.write_bytes(payload[:start] + b"\x00" * 64 + payload[start + 64:])
    result = CliRunner().invoke(precompute_features_command, [str(data), "--out", str(tmp_path / "feat"), *OPTIONS,
                                                              "--workers", "2", "--batch-size", "2"])
    _one_line(result, 1, "train-000002.tar [sample train_00008]", "cannot decode")
    assert not (tmp_path / "feat" / "train-000002.pt").exists()


def test_a_shard_without_samples_gets_an_empty_feature_file(tmp_path):
    data = tmp_path / "data"
    make_shard_dataset(data, shard_sizes={"train": [3, 0, 2]})
    result = CliRunner().invoke(precompute_features_command, [str(data), "--out", str(tmp_path / "feat"), *OPTIONS,
                                                              "--workers", "0", "--augment", "--views", "2"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["complete"] and summary["shards_done"] == 3 and summary["images"] == 5
    empty = torch.load(tmp_path / "feat" / "train-000001.pt", weights_only=True)
    assert empty["features"].shape == (0, 512) and empty["views"].shape == (0, 2, 512) and empty["keys"] == []
    assert verify_feature_folder(tmp_path / "feat", full=True) == []
