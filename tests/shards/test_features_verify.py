"""verify_feature_folder: missing and altered files, stale sources, and (full) rows, keys and labels that misalign."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shards.formats.features import FeatureShard, write_feature_shard
from shards.check.features_verify import verify_feature_folder
from shards.transport.manifest_io import dataset_sha256_at
from shards.manifest import FeatureManifest, ShardInfo, SplitInfo
from shards.transport.storage import get_storage
from tests.helpers import make_shard_dataset

DIM = 8


def _feature_folder(tmp_path: Path, *, storage: str = "pt", shard_sizes=None, keys_of=None) -> Path:
    """A feature folder written directly (no model): random features aligned with a generated image dataset."""
    data_dir, out = tmp_path / "data", tmp_path / "feat"
    dataset = make_shard_dataset(data_dir, shard_sizes=shard_sizes or {"train": [3, 4], "val": [2]})
    generator = torch.Generator().manual_seed(0)
    splits = {}
    for name, split in dataset.splits.items():
        infos = []
        for image_shard in split.shards:
            samples = list(get_storage(dataset.storage).read(data_dir / image_shard.path))
            keys = [s.key for s in samples]
            shard = FeatureShard(torch.randn(len(samples), DIM, generator=generator).half(),
                                 torch.tensor([s.label for s in samples]), keys_of(keys) if keys_of else keys)
            path = out / (Path(image_shard.path).stem + (".pt" if storage == "pt" else ".h5"))
            out.mkdir(exist_ok=True)
            size, sha = write_feature_shard(path, shard, storage)
            infos.append(ShardInfo(path.name, len(samples), size, sha, image_shard.path, image_shard.sha256))
        splits[name] = SplitInfo(split.samples, split.class_counts, tuple(infos))
    FeatureManifest(storage, dataset.classes, splits, DIM, "float16", 0, {"backbone": "test"}, "abc",
                    str(data_dir), dataset_sha256_at(data_dir)).save(out)
    return out


def test_an_intact_current_folder_has_no_problems(tmp_path):
    folder = _feature_folder(tmp_path)
    assert verify_feature_folder(folder) == []
    assert verify_feature_folder(folder, full=True) == []


def test_hdf5_feature_folders_verify_too(tmp_path):
    assert verify_feature_folder(_feature_folder(tmp_path, storage="hdf5"), full=True) == []


def test_missing_and_altered_feature_files(tmp_path):
    folder = _feature_folder(tmp_path)
    (folder / "train-000000.pt").unlink()
    damaged = bytearray((folder / "val-000000.pt").read_bytes())
    damaged[-30] ^= 0xFF
    (folder / "val-000000.pt").write_bytes(bytes(damaged))
    problems = verify_feature_folder(folder)
    assert len(problems) == 2
    assert "train-000000.pt: feature shard missing" in problems[0]
    assert "val-000000.pt: sha256 does not match" in problems[1]


def test_a_changed_dataset_makes_the_cache_stale(tmp_path):
    folder = _feature_folder(tmp_path, shard_sizes={"train": [3, 4]})
    make_shard_dataset(tmp_path / "data", shard_sizes={"train": [3, 5]})  # second shard repacked differently
    problems = verify_feature_folder(folder)
    assert any("stale" in p and "dataset.json changed" in p for p in problems)
    assert any("train-000001.pt: stale: source shard train-000001.tar changed" in p for p in problems)
    assert not any("train-000000.pt" in p for p in problems)


def test_a_removed_source_shard_and_a_missing_dataset(tmp_path):
    folder = _feature_folder(tmp_path, shard_sizes={"train": [3, 4]})
    make_shard_dataset(tmp_path / "data", shard_sizes={"train": [3]})
    assert any("source shard train-000001.tar is no longer in the dataset" in p
               for p in verify_feature_folder(folder))
    (tmp_path / "data" / "dataset.json").unlink()
    assert any("cannot check staleness" in p for p in verify_feature_folder(folder))


def test_full_checks_keys_against_the_image_shards(tmp_path):
    folder = _feature_folder(tmp_path, keys_of=lambda keys: list(reversed(keys)))
    assert verify_feature_folder(folder) == []  # checksums and sources are fine
    problems = verify_feature_folder(folder, full=True)
    assert problems and all("keys differ" in p for p in problems)


def test_full_checks_rows_against_the_manifest(tmp_path):
    folder = _feature_folder(tmp_path)
    manifest = json.loads((folder / "features.json").read_text())
    manifest["features_dim"] = DIM + 1
    manifest["splits"]["val"]["shards"][0]["samples"] = 5
    (folder / "features.json").write_text(json.dumps(manifest))
    problems = verify_feature_folder(folder, full=True)
    assert any("val-000000.pt: 2 rows and 2 keys, features.json records 5" in p for p in problems)
    assert sum("expected [N, 9]" in p for p in problems) == 3


def test_a_folder_without_features_json_is_one_problem(tmp_path):
    problems = verify_feature_folder(tmp_path)
    assert len(problems) == 1 and "features.json" in problems[0]


def test_misaligned_keys_name_the_sample(tmp_path):
    folder = _feature_folder(tmp_path, shard_sizes={"train": [3]}, keys_of=lambda keys: [keys[0], "x", keys[2]])
    problems = verify_feature_folder(folder, full=True)
    assert any("train-000000.pt [sample x]: keys differ" in p and "first at row 1" in p and "train_00001" in p
               for p in problems), problems
