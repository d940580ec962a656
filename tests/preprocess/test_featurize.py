"""precompute-features: features equal a direct computation, files align with shards, runs resume and refuse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision.transforms as T
from click.testing import CliRunner

from preprocess.features.backbones import build_backbone
from preprocess.features.featurize import FeatureConfig, merge_features, precompute_features, run_precompute
from preprocess.features.cli import precompute_features_command
from shards.image.decode import decode_image
from shards.errors import OutputExistsError, ShardcacheError
from shards.formats.features import load_feature_shard
from shards.check.features_verify import verify_feature_folder
from shards.manifest import load_dataset_manifest, load_feature_manifest
from shards.transport.storage import get_storage
from tests.helpers import make_shard_dataset

SHARDS = {"train": [5, 3, 4], "val": [4]}
SMALL = dict(backbone="resnet18", weights="none", resize=40, crop=32, batch_size=4, workers=0, quiet=True)




@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("datasets")
    return {storage: (root / storage, make_shard_dataset(root / storage, shard_sizes=SHARDS, storage=storage))
            for storage in ("tar", "hdf5")}


def _config(data_dir: Path, out_dir: Path, **changes) -> FeatureConfig:
    return FeatureConfig(data_dir=data_dir, out_dir=out_dir, **{**SMALL, **changes})


def _file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix in (".pt", ".h5")}


def _reference(data_dir: Path) -> dict[str, tuple[torch.Tensor, int]]:
    """Features computed straight from each sample's bytes with torchvision's own eval transform."""
    dataset = load_dataset_manifest(data_dir)
    model = build_backbone("resnet18", "none", seed=0).model
    transform = T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor(),
                           T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    out = {}
    for split in dataset.splits.values():
        for shard in split.shards:
            for sample in get_storage(dataset.storage).read(data_dir / shard.path):
                with torch.inference_mode():
                    features = model(transform(decode_image(sample.data))[None])[0]
                out[sample.key] = (features, sample.label)
    return out


@pytest.mark.parametrize("storage,fmt", [pytest.param("tar", "pt", marks=pytest.mark.slow), pytest.param("hdf5", "hdf5", marks=pytest.mark.slow)])
def test_features_equal_direct_computation_and_align_with_shards(datasets, tmp_path, storage, fmt):
    data_dir, dataset = datasets[storage]
    manifest = precompute_features(_config(data_dir, tmp_path / "feat", storage=fmt))
    assert manifest is not None and manifest.features_dim == 512 and manifest.dtype == "float16"
    assert load_feature_manifest(tmp_path / "feat") == manifest
    reference = _reference(data_dir)
    for name, split in manifest.splits.items():
        assert [s.source for s in split.shards] == [s.path for s in dataset.splits[name].shards]
        for info, image_shard in zip(split.shards, dataset.splits[name].shards):
            shard = load_feature_shard(tmp_path / "feat" / info.path)
            samples = list(get_storage(storage).read(data_dir / image_shard.path))
            assert shard.keys == [s.key for s in samples]
            assert shard.labels.tolist() == [s.label for s in samples]
            assert shard.features.dtype == torch.float16 and info.source_sha256 == image_shard.sha256
            expected = torch.stack([reference[key][0] for key in shard.keys])
            # float16 keeps 11 significant bits: a relative error of at most 2**-11, plus float noise.
            assert ((shard.features.float() - expected).abs() <= expected.abs() * 2**-10 + 1e-4).all()
    assert verify_feature_folder(tmp_path / "feat", full=True) == []


@pytest.mark.slow  # over half a second in the quick loop
def test_float32_keeps_full_precision_and_pt_files_load_mmapped(datasets, tmp_path):
    data_dir, _ = datasets["tar"]
    manifest = precompute_features(_config(data_dir, tmp_path / "feat", dtype="float32", splits=("val",)))
    assert list(manifest.splits) == ["val"]
    path = tmp_path / "feat" / manifest.splits["val"].shards[0].path
    data = torch.load(path, weights_only=True, mmap=True)
    assert set(data) == {"features", "labels", "keys"} and data["features"].dtype == torch.float32
    reference = _reference(data_dir)
    expected = torch.stack([reference[key][0] for key in data["keys"]])
    assert torch.allclose(data["features"], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_resume_after_a_kill_gives_the_files_of_an_uninterrupted_run(datasets, tmp_path):
    data_dir, _ = datasets["tar"]
    precompute_features(_config(data_dir, tmp_path / "whole"))
    interrupted = tmp_path / "resumed"
    precompute_features(_config(data_dir, interrupted, workers=2))
    # Simulate a kill while writing train-000001: its file never got renamed, features.json never written.
    (interrupted / "train-000001.pt").rename(interrupted / "train-000001.pt.node7.4242.0badc0de.tmp")
    (interrupted / "features.json").unlink()
    (interrupted / "val-000000.pt").write_bytes(b"truncated")  # and one damaged file, caught by its checksum
    manifest, summary = run_precompute(_config(data_dir, interrupted))
    assert summary["shards_done"] == 2 and summary["shards_skipped"] == 2 and summary["complete"]
    assert _file_bytes(interrupted) == _file_bytes(tmp_path / "whole")
    assert not list(interrupted.glob("*.tmp"))
    assert manifest.splits == load_feature_manifest(tmp_path / "whole").splits
    _, again = run_precompute(_config(data_dir, interrupted))
    assert again["shards_done"] == 0 and again["shards_skipped"] == 4


@pytest.mark.slow  # over half a second in the quick loop
def test_a_different_config_refuses_without_overwrite(datasets, tmp_path):
    data_dir, _ = datasets["tar"]
    first = precompute_features(_config(data_dir, tmp_path / "feat"))
    before = _file_bytes(tmp_path / "feat")
    with pytest.raises(OutputExistsError, match="different config .* differs in transform"):
        precompute_features(_config(data_dir, tmp_path / "feat", crop=24, resize=30))
    assert _file_bytes(tmp_path / "feat") == before
    second = precompute_features(_config(data_dir, tmp_path / "feat", crop=24, resize=30, overwrite=True))
    assert second.config_hash != first.config_hash and second.config["transform"]["crop"] == 24


def test_a_folder_holding_other_files_is_not_written_into(datasets, tmp_path):
    data_dir, _ = datasets["tar"]
    (tmp_path / "feat").mkdir()
    (tmp_path / "feat" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="did not write"):
        precompute_features(_config(data_dir, tmp_path / "feat"))


@pytest.mark.slow  # over half a second in the quick loop
def test_an_appended_dataset_is_stale_and_only_new_shards_are_featurised(tmp_path):
    data_dir = tmp_path / "data"
    make_shard_dataset(data_dir, shard_sizes={"train": [4, 3]})
    precompute_features(_config(data_dir, tmp_path / "feat"))
    make_shard_dataset(data_dir, shard_sizes={"train": [4, 3, 5]})  # same first shards, one appended
    problems = verify_feature_folder(tmp_path / "feat")
    assert any("dataset.json changed" in p for p in problems)
    assert any("1 image shard(s) without features" in p for p in problems)
    manifest, summary = run_precompute(_config(data_dir, tmp_path / "feat"))
    assert summary["shards_done"] == 1 and summary["shards_skipped"] == 2
    assert [s.path for s in manifest.splits["train"].shards] == [f"train-00000{i}.pt" for i in range(3)]
    assert verify_feature_folder(tmp_path / "feat", full=True) == []


@pytest.mark.slow  # three featurize runs
def test_task_array_writes_features_json_when_the_last_part_exists(datasets, tmp_path):
    data_dir, _ = datasets["hdf5"]
    first, summary = run_precompute(_config(data_dir, tmp_path / "feat", task_index=0, num_tasks=2))
    assert first is None and not summary["complete"] and summary["shards_done"] == 2
    assert not (tmp_path / "feat" / "features.json").exists()
    with pytest.raises(ShardcacheError, match="2 of 4 feature shards are missing"):
        merge_features(tmp_path / "feat")
    last = precompute_features(_config(data_dir, tmp_path / "feat", task_index=1, num_tasks=2))
    assert last is not None
    (tmp_path / "feat" / "features.json").unlink()
    assert merge_features(tmp_path / "feat").splits == last.splits
    precompute_features(_config(data_dir, tmp_path / "single"))
    assert _file_bytes(tmp_path / "feat") == _file_bytes(tmp_path / "single")


@pytest.mark.slow  # two featurize runs, one with worker processes
def test_augmented_views_are_seeded_per_key_not_per_worker(datasets, tmp_path):
    data_dir, _ = datasets["tar"]
    views = dict(views=2, augment=True, splits=("train",))
    one = precompute_features(_config(data_dir, tmp_path / "one", **views))
    two = precompute_features(_config(data_dir, tmp_path / "two", workers=2, batch_size=3, **views))
    assert one.views == 2 and one.config_hash == two.config_hash
    for info in one.splits["train"].shards:
        a, b = (load_feature_shard(tmp_path / d / info.path) for d in ("one", "two"))
        assert a.views.shape == (len(a), 2, 512)
        assert torch.allclose(a.views.float(), b.views.float(), atol=2e-3, rtol=2e-3)
        assert not torch.allclose(a.views[:, 0].float(), a.views[:, 1].float(), atol=1e-2)
        assert not torch.allclose(a.views[:, 0].float(), a.features.float(), atol=1e-2)
    assert verify_feature_folder(tmp_path / "one", full=True) == []


@pytest.mark.parametrize("decode, recorded", [pytest.param("device", "decode_jpeg:cpu", marks=pytest.mark.slow),
                                              pytest.param("fast", "fast", marks=pytest.mark.slow)])
def test_other_decode_paths_match_the_pil_reference_closely(datasets, tmp_path, decode, recorded):
    """``--decode device`` run on the CPU (tensor resize instead of PIL's) and ``--decode fast`` (crop-then-resize)
    give nearly the reference (``--decode standard``) features, views included. The recorded decoder names are the
    ones earlier versions recorded, so existing feature folders keep their config hash."""
    data_dir, _ = datasets["tar"]
    options = dict(dtype="float32", views=1, augment=True, splits=("train",))
    reference = precompute_features(_config(data_dir, tmp_path / "standard", decode="standard", **options))
    dev = precompute_features(_config(data_dir, tmp_path / "dev", decode=decode, **options))
    assert reference.config["decode"] == "pil" and dev.config["decode"] == recorded
    for info in reference.splits["train"].shards:
        a, b = (load_feature_shard(tmp_path / d / info.path) for d in ("standard", "dev"))
        assert a.keys == b.keys
        for x, y in ((a.features, b.features), (a.views[:, 0], b.views[:, 0])):
            assert torch.nn.functional.cosine_similarity(x, y).min() > 0.999
            assert (x - y).abs().max() < 0.05 * x.abs().max()


BAD_INPUTS = {
    "missing dataset": (lambda tmp: [str(tmp / "nowhere")], "dataset.json"),
    "unknown backbone": (lambda tmp: ["--backbone", "resnet19"], "unknown backbone"),
    "weights for another architecture": (lambda tmp: ["--weights", str(_r34(tmp))], "do not fit resnet18"),
    "corrupt weights": (lambda tmp: ["--weights", str(_junk(tmp))], "not a readable weights file"),
}


def _r34(tmp: Path) -> Path:
    import torchvision

    torch.save(torchvision.models.resnet34(weights=None).state_dict(), tmp / "r34.pt")
    return tmp / "r34.pt"


def _junk(tmp: Path) -> Path:
    (tmp / "junk.pth").write_bytes(b"\x00garbage" * 10)
    return tmp / "junk.pth"


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow)  # builds a resnet34 state dict
                                  if case == "weights for another architecture" else case
                                  for case in sorted(BAD_INPUTS)])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(datasets, tmp_path, case):
    make_args, expected = BAD_INPUTS[case]
    data_dir, _ = datasets["tar"]
    args = [str(data_dir), "--out", str(tmp_path / "feat"), "--backbone", "resnet18", "--weights", "none",
            "--crop", "32", "--workers", "0", "-q"]
    extra = make_args(tmp_path)
    args = extra + args[1:] if case == "missing dataset" else args + extra
    result = CliRunner().invoke(precompute_features_command, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
    assert not (tmp_path / "feat").exists()


@pytest.mark.slow  # over half a second in the quick loop
def test_cli_prints_one_json_summary_and_merge(datasets, tmp_path):
    data_dir, _ = datasets["tar"]
    base = [str(data_dir), "--out", str(tmp_path / "feat"), "--backbone", "resnet18", "--weights", "none",
            "--crop", "32", "--workers", "0", "-q", "--num-tasks", "2"]
    runner = CliRunner()
    for index in ("0", "1"):
        result = runner.invoke(precompute_features_command, [*base, "--task-index", index])
        assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip())
    assert summary["complete"] and summary["images_per_s"] > 0 and 0 <= summary["data_wait_share"] <= 1
    merged = runner.invoke(precompute_features_command, ["--merge", str(tmp_path / "feat")])
    assert merged.exit_code == 0 and json.loads(merged.stdout)["shards_total"] == 4
    missing = runner.invoke(precompute_features_command, [str(data_dir), "--out", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "--weights" in missing.stderr


def test_a_corrupt_sample_fails_naming_its_shard_and_key(tmp_path):
    data_dir = tmp_path / "data"
    make_shard_dataset(data_dir, shard_sizes={"train": [3]})
    shard = data_dir / "train-000000.tar"
    payload = shard.read_bytes()
    start = payload.index(b"\xff\xd8\xff")  # the first JPEG's header
    shard.write_bytes(payload[:start] + b"\x00" * 64 + payload[start + 64:])
    with pytest.raises(ShardcacheError, match=r"train-000000.tar \[sample train_00000\]"):
        precompute_features(_config(data_dir, tmp_path / "feat"))
    assert not (tmp_path / "feat" / "features.json").exists()


@pytest.mark.parametrize("recorded, ok", [
    ("s3://bucket/some/prefix", True), ("s3://bucket", True), ("/abs/data", True), ("../data", True),
    ("s3://bucket/a\nb", False), ("s3://bucket/a b", False), ("s3://bucket/../x", False), ("s3://bucket//x", False),
    ("s3://-x/y", False), ("pipe:aws s3 cp s3://b/x -", False), ("https://host/data", False), ("file:///data", False),
])
def test_dataset_dir_is_a_local_folder_or_an_s3_url_only(recorded, ok):
    from shards.errors import ManifestError
    from shards.door.locations import check_dataset_dir

    if ok:
        assert check_dataset_dir(recorded) == recorded
    else:
        with pytest.raises(ManifestError):
            check_dataset_dir(recorded)


def test_an_s3_dataset_dir_is_followed_only_from_s3_features_or_when_named(tmp_path):
    from shards.door.locations import dataset_location

    assert dataset_location("s3://bkt/feat", "s3://bkt/data/") == ("s3://bkt/data", None)
    location, why = dataset_location(tmp_path, "s3://bkt/data")
    assert location is None and "not followed" in why
    assert dataset_location(tmp_path, "s3://bkt/data", explicit="s3://bkt/data") == ("s3://bkt/data", None)
    assert dataset_location("s3://bkt/feat", "../data")[0] is None
    location, why = dataset_location("s3://bkt/feat", str(tmp_path / "data"))  # a remote manifest naming a local path
    assert location is None and "local path" in why
    location, why = dataset_location("s3://bkt/feat", "s3://other/data")
    assert location is None and "another bucket" in why
    assert dataset_location(tmp_path, "data") == (tmp_path / "data", None)


@pytest.mark.slow  # two featurize runs through the CLI
def test_features_through_the_node_cache_are_the_same_bytes(datasets, tmp_path):
    data_dir, _ = datasets["tar"]
    base = [str(data_dir), "--backbone", "resnet18", "--weights", "none", "--crop", "32", "--workers", "1", "-q"]
    runner = CliRunner()
    plain = runner.invoke(precompute_features_command, [*base, "--out", str(tmp_path / "plain")])
    cached = runner.invoke(precompute_features_command, [*base, "--out", str(tmp_path / "cached"),
                                                         "--cache-dir", str(tmp_path / "node"), "--cache-local"])
    assert plain.exit_code == 0 and cached.exit_code == 0, cached.output
    assert _file_bytes(tmp_path / "plain") == _file_bytes(tmp_path / "cached")
    copies = sorted(p.name for p in (tmp_path / "node").rglob("*.tar"))
    manifest = json.loads((data_dir / "dataset.json").read_text())
    assert copies == sorted(f"{s['sha256']}.tar" for split in manifest["splits"].values() for s in split["shards"])
