"""shards verify: a clean folder passes; every kind of damage fails and names the shard (and sample)."""

import json

import torch

from click.testing import CliRunner

from shards.cli.main import main
from shards.manifest import ShardInfo, load_dataset_manifest
from shards.formats.sample import RawSample
from shards.transport.storage import STORAGES
from shards.check.verify import verify_dataset
from shards.check.verify_core import decode_positions
from tests.helpers import class_image, make_shard_dataset


def verify_cli(*args):
    return CliRunner().invoke(main, ["verify", *map(str, args)])


def test_clean_dataset_passes(tmp_path):
    make_shard_dataset(tmp_path)
    report = verify_dataset(tmp_path, samples_per_shard=2)
    assert report.ok and report.problems == ()
    assert report.shards_checked == 6 and report.samples_read == 36
    assert report.samples_decoded == 12
    assert verify_dataset(tmp_path, full=True).samples_decoded == 36
    result = verify_cli(tmp_path)
    assert result.exit_code == 0 and json.loads(result.stdout)["ok"] is True


def test_flipped_byte_fails_the_checksum_and_names_the_shard(tmp_path):
    manifest = make_shard_dataset(tmp_path)
    shard = tmp_path / manifest.splits["train"].shards[1].path
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x01
    shard.write_bytes(bytes(data))
    result = verify_cli(tmp_path)
    assert result.exit_code == 1
    assert "train-000001.tar: sha256" in result.stderr
    assert json.loads(result.stdout)["ok"] is False


def test_truncated_and_missing_shards_are_named(tmp_path):
    manifest = make_shard_dataset(tmp_path)
    first, second = (tmp_path / s.path for s in manifest.splits["train"].shards[:2])
    first.write_bytes(first.read_bytes()[:3000])
    second.unlink()
    problems = verify_dataset(tmp_path).problems
    assert any(p.startswith("train-000000.tar: size") for p in problems)
    assert any(p.startswith("train-000000.tar: holds") for p in problems)
    assert "train-000001.tar: missing" in problems


def test_undecodable_image_names_the_sample_with_full(tmp_path):
    """A shard whose checksum matches the manifest but holds a corrupt image: only decoding finds it."""
    manifest = make_shard_dataset(tmp_path, shard_sizes={"train": [6]})
    path = tmp_path / "train-000000.tar"
    samples = list(STORAGES["tar"].read(path))
    samples[3] = samples[3]._replace(data=class_image(0, 3)[:200])
    with STORAGES["tar"].writer(path) as writer:
        for sample in samples:
            writer.write(sample)
    split = manifest.splits["train"]
    shard = ShardInfo(split.shards[0].path, 6, writer.bytes, writer.sha256)
    manifest.replace(splits={"train": split.__class__(6, split.class_counts, (shard,))}).save(tmp_path)
    assert verify_dataset(tmp_path, samples_per_shard=2).ok  # positions 0 and 5 decode fine
    report = verify_dataset(tmp_path, full=True)
    assert not report.ok
    assert report.problems[0].startswith(f"train-000000.tar [sample {samples[3].key}]: image does not decode")


def test_wrong_sample_count_and_bad_label_are_reported(tmp_path):
    make_shard_dataset(tmp_path, shard_sizes={"train": [4]})
    path = tmp_path / "train-000000.tar"
    samples = list(STORAGES["tar"].read(path)) + [RawSample("extra", class_image(1, 9), "jpg", 7, b"{}")]
    with STORAGES["tar"].writer(path) as writer:
        for sample in samples:
            writer.write(sample)
    manifest = load_dataset_manifest(tmp_path)
    split = manifest.splits["train"]
    shard = ShardInfo(split.shards[0].path, 4, writer.bytes, writer.sha256)
    manifest.replace(splits={"train": split.__class__(4, split.class_counts, (shard,))}).save(tmp_path)
    problems = verify_dataset(tmp_path).problems
    assert "train-000000.tar [sample extra]: label 7 is outside [0, 3)" in problems
    assert "train-000000.tar: holds 5 samples, manifest says 4" in problems


def test_feature_folders_are_checked_by_the_feature_verifier(tmp_path):
    """``shards verify`` on a features.json folder runs the feature checks: a file altered after the manifest was
    written is named, and the JSON result says it was a feature folder."""
    from shards.formats.features import FeatureShard, write_feature_shard
    from tests.shards.stream_helpers import write_feature_dataset

    write_feature_dataset(tmp_path / "feats", [4, 3])
    altered = tmp_path / "feats" / "train-000000.pt"
    write_feature_shard(altered, FeatureShard(torch.zeros(3, 4).half(), torch.zeros(3, dtype=torch.int64),
                                              ["x0", "x1", "x2"]), "pt")
    result = verify_cli(tmp_path / "feats", "--full")
    assert result.exit_code == 1
    assert "train-000000.pt" in result.stderr and "train-000001.pt" not in result.stderr
    report = json.loads(result.stdout)
    assert report["kind"] == "features" and report["ok"] is False and report["shards_checked"] == 2


def test_not_a_dataset_folder_exits_2(tmp_path):
    result = verify_cli(tmp_path)
    assert result.exit_code == 2 and "neither dataset.json nor features.json" in result.stderr


def test_decode_positions_spread_and_are_stable():
    assert decode_positions(10, 3) == {0, 4, 9} == decode_positions(10, 3)
    assert decode_positions(2, 5) == {0, 1}
    assert decode_positions(0, 4) == set() and decode_positions(7, 1) == {0}


def test_a_shard_unreadable_midway_names_the_last_sample_read(tmp_path):
    make_shard_dataset(tmp_path, shard_sizes={"train": [6]}, size=(16, 16))
    path = tmp_path / "train-000000.tar"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2 + 700])  # cut inside a tar header, after a few whole samples
    unreadable = [p for p in verify_dataset(tmp_path).problems if "unreadable" in p]
    assert len(unreadable) == 1 and unreadable[0].startswith("train-000000.tar [after sample train_0000")


def test_wrong_per_shard_class_counts_are_reported(tmp_path):
    # A subset skips shards by these counts unread, so a wrong one would silently drop samples.
    make_shard_dataset(tmp_path, shard_sizes={"train": [6, 3]})
    manifest = load_dataset_manifest(tmp_path)
    split = manifest.splits["train"]
    first, second = split.shards
    shards = (first.__class__(**{**first.__dict__, "class_counts": (2, 2, 2)}),
              second.__class__(**{**second.__dict__, "class_counts": (3, 0, 0)}))
    manifest.replace(splits={"train": split.__class__(9, split.class_counts, shards)}).save(tmp_path)
    problems = verify_dataset(tmp_path).problems
    assert problems == ("train-000001.tar: class counts [1, 1, 1] differ from the manifest's per-shard [3, 0, 0]",)
