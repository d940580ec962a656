"""``precompute-features s3://...``: features of a dataset on object storage equal those of its local copy, reruns
skip finished shards, and a changed remote ``dataset.json`` makes them stale for ``shards verify`` and
``train-from-shards``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from preprocess.features.cli import precompute_features_command
from shards.cli.main import main as shards_command
from shards.formats.features import load_feature_shard
from shards.manifest import load_feature_manifest
from tests.helpers import make_shard_dataset
from train.cli import train_command

pytestmark = [pytest.mark.s3, pytest.mark.slow]  # slow: starting and stopping SeaweedFS takes seconds
SHARDS = {"train": [5, 3, 4], "val": [4]}
SMALL = ["--backbone", "resnet18", "--weights", "none", "--resize", "40", "--crop", "32", "--batch-size", "4",
         "--workers", "0", "--device", "cpu", "--quiet"]


def featurize(data: str | Path, out: str | Path, *extra: str):
    result = CliRunner().invoke(precompute_features_command, [str(data), "--out", str(out), *SMALL, *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def same_features(a: Path, b: Path) -> None:
    one, two = load_feature_manifest(a), load_feature_manifest(b)
    assert one.splits == two.splits and one.config_hash == two.config_hash  # names, sizes, sha256, sources
    for split in one.splits.values():
        for info in split.shards:
            x, y = load_feature_shard(a / info.path), load_feature_shard(b / info.path)
            assert x.keys == y.keys and x.labels.equal(y.labels) and x.features.equal(y.features)


def put_json(bucket, key: str, data) -> None:
    bucket.client.put_object(Bucket=bucket.name, Key=f"{bucket.prefix}/{key}", Body=json.dumps(data).encode())


def get_json(bucket, key: str):
    return json.loads(bucket.client.get_object(Bucket=bucket.name, Key=f"{bucket.prefix}/{key}")["Body"].read())


@pytest.mark.parametrize("storage", ["tar", "hdf5"])
def test_features_from_s3_equal_those_of_the_local_copy(bucket, tmp_path, storage):
    local = tmp_path / "data"
    make_shard_dataset(local, shard_sizes=SHARDS, storage=storage)
    url = bucket.upload(local, "data")
    featurize(local, tmp_path / "from-local")
    summary = featurize(url + "/", tmp_path / "from-s3")
    assert summary["complete"] and summary["shards_done"] == 4
    same_features(tmp_path / "from-local", tmp_path / "from-s3")
    manifest = load_feature_manifest(tmp_path / "from-s3")
    assert manifest.dataset_dir == url  # the URL, without the trailing slash
    assert manifest.dataset_sha256 == hashlib.sha256((local / "dataset.json").read_bytes()).hexdigest()
    # --out s3:// too (one run, input and output on object storage): the same files are uploaded
    featurize(url, bucket.url("feat"), "--stage-dir", str(tmp_path / "stage"))
    same_features(tmp_path / "from-s3", tmp_path / "stage")
    assert get_json(bucket, "feat/features.json")["dataset_dir"] == url


def test_a_rerun_skips_finished_shards(bucket, tmp_path):
    local = tmp_path / "data"
    make_shard_dataset(local, shard_sizes=SHARDS)
    url = bucket.upload(local, "data")
    featurize(url, tmp_path / "feat", "--workers", "2")  # forked DataLoader workers make their own clients
    first = {p.name: p.read_bytes() for p in (tmp_path / "feat").glob("*.pt")}
    again = featurize(url, tmp_path / "feat")
    assert (again["shards_done"], again["shards_skipped"]) == (0, 4)
    (tmp_path / "feat" / "train-000001.pt").unlink()  # as if killed before this shard was written
    (tmp_path / "feat" / "features.json").unlink()
    resumed = featurize(url, tmp_path / "feat")
    assert (resumed["shards_done"], resumed["shards_skipped"], resumed["complete"]) == (1, 3, True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "feat").glob("*.pt")} == first
    merged = CliRunner().invoke(precompute_features_command, ["--merge", str(tmp_path / "feat"), "--quiet"])
    assert merged.exit_code == 0, merged.output  # reads the remote dataset.json again
    # the config check still refuses another config in the same folder
    other = CliRunner().invoke(precompute_features_command, [url, "--out", str(tmp_path / "feat"), *SMALL,
                                                             "--seed", "1"])
    assert other.exit_code == 2 and "different config" in other.output


def test_a_shard_whose_bytes_differ_from_dataset_json_is_refused(bucket, tmp_path):
    local = tmp_path / "data"
    make_shard_dataset(local, shard_sizes=SHARDS)
    url = bucket.upload(local, "data")
    swapped = (local / "train-000002.tar").read_bytes()
    bucket.put("data/train-000000.tar", (local / "train-000000.tar").read_bytes()[:-1] + b"\x01")  # same size
    result = CliRunner().invoke(precompute_features_command, [url, "--out", str(tmp_path / "feat"), *SMALL])
    assert result.exit_code == 1 and "train-000000.tar" in result.output and "sha256" in result.output
    assert not list((tmp_path / "feat").glob("train-000000.*"))
    bucket.put("data/train-000000.tar", swapped)  # another shard's bytes: parsed fine, size differs
    result = CliRunner().invoke(precompute_features_command, [url, "--out", str(tmp_path / "feat"), *SMALL])
    assert result.exit_code == 1 and "train-000000.tar" in result.output


def test_a_missing_shard_object_is_one_line_exit_2(bucket, tmp_path):
    local = tmp_path / "data"
    make_shard_dataset(local, shard_sizes=SHARDS)
    url = bucket.upload(local, "data", skip=lambda path: path.name == "val-000000.tar")
    result = CliRunner().invoke(precompute_features_command, [url, "--out", str(tmp_path / "feat"), *SMALL])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "val-000000.tar" in lines[0] and "404" in lines[0]


def test_changed_remote_dataset_json_makes_s3_features_stale(bucket, tmp_path):
    local = tmp_path / "data"
    make_shard_dataset(local, shard_sizes=SHARDS)
    url = bucket.upload(local, "data")
    featurize(url, bucket.url("feat"), "--stage-dir", str(tmp_path / "stage"))
    feat = bucket.url("feat")
    verify = CliRunner().invoke(shards_command, ["verify", feat, "--quiet"])
    assert verify.exit_code == 0, verify.output
    train = [feat, "--out", str(tmp_path / "run"), "--batch-size", "4", "--dry-run", "--device", "cpu", "--quiet"]
    assert CliRunner().invoke(train_command, train).exit_code == 0

    manifest = json.loads((local / "dataset.json").read_text())
    put_json(bucket, "data/dataset.json", {**manifest, "packing": {"seed": 1}})  # repacked since
    verify = CliRunner().invoke(shards_command, ["verify", feat, "--quiet"])
    assert verify.exit_code == 1 and "stale" in verify.stderr and f"{url}/dataset.json changed" in verify.stderr
    result = CliRunner().invoke(train_command, train)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "stale features" in lines[0]

    bucket.client.delete_object(Bucket=bucket.name, Key=f"{bucket.prefix}/data/dataset.json")  # unreachable
    result = CliRunner().invoke(train_command, train)  # warns and goes on, as with a deleted local dataset
    assert result.exit_code == 0, result.output
    assert "cannot check freshness" in result.stderr and "404" in result.stderr


def test_local_features_do_not_follow_an_s3_dataset_dir(bucket, tmp_path, monkeypatch):
    local = tmp_path / "data"
    make_shard_dataset(local, shard_sizes=SHARDS)
    url = bucket.upload(local, "data")
    featurize(url, tmp_path / "feat")
    from shards.transport import s3_ranges

    def no_requests(*args, **kwargs):
        raise AssertionError("an s3:// dataset_dir of a local features.json was followed")

    monkeypatch.setattr(s3_ranges, "open_range", no_requests)
    verify = CliRunner().invoke(shards_command, ["verify", str(tmp_path / "feat"), "--quiet"])
    assert verify.exit_code == 0, verify.output
    assert "not followed" in verify.stderr
    monkeypatch.undo()
    from shards.check.freshness import check_features_fresh
    from shards.errors import StaleCacheError

    manifest = load_feature_manifest(tmp_path / "feat")
    check_features_fresh(tmp_path / "feat", manifest, dataset_dir=url)  # named explicitly: followed, fresh
    put_json(bucket, "data/dataset.json", {**json.loads((local / "dataset.json").read_text()), "packing": {}})
    with pytest.raises(StaleCacheError):
        check_features_fresh(tmp_path / "feat", manifest, dataset_dir=url)
