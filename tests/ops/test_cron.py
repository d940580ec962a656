"""The nightly cron job: append -> features -> train under a lock, a log per run, a clear failure line."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
from pathlib import Path

import pytest

import torch

from shards.manifest import load_dataset_manifest, load_feature_manifest
from tests.helpers import class_image, write_image_folder

ROOT = Path(__file__).resolve().parents[2]
NIGHTLY = ROOT / "scripts" / "cron" / "nightly"
VENV = Path(sys.executable).parent.parent
CLASSES = ["ant", "bee", "cow"]


def _paths(tmp_path: Path) -> dict[str, Path]:
    return {name: tmp_path / name for name in ("src", "data", "feat", "runs", "logs")}


def _nightly(paths: dict[str, Path], *extra: str) -> subprocess.CompletedProcess:
    argv = ["bash", str(NIGHTLY), "--venv", str(VENV), "--source", str(paths["src"]),
            "--data-dir", str(paths["data"]), "--feat-dir", str(paths["feat"]), "--runs-dir", str(paths["runs"]),
            "--log-dir", str(paths["logs"]), "--backbone", "resnet18", "--weights", "none",
            "--pack-args", "--shard-samples 4 --val-fraction 0.25 --seed 3",
            "--features-args", "--resize 32 --crop 32 --batch-size 8 --workers 0 --device cpu",
            "--train-args", "--head linear --epochs 1 --batch-size 4 --workers 0 --device cpu", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240)


def _stamps(folder: Path, pattern: str) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob(pattern)}


def _latest_run(paths: dict[str, Path]) -> tuple[list[dict], dict]:
    run = paths["runs"] / "latest"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return metrics, torch.load(run / "model.pt", weights_only=True, map_location="cpu")


def _logs(paths: dict[str, Path]) -> list[Path]:
    return sorted(paths["logs"].glob("nightly-*.log"))


def _add_images(src: Path, per_class: int, start: int) -> None:
    for label, name in enumerate(CLASSES):
        for i in range(start, start + per_class):
            (src / name / f"img_{i:04d}.jpg").write_bytes(class_image(label, i, (32, 32)))


@pytest.mark.slow
def test_second_night_packs_only_new_files_and_trains_on_them(tmp_path):
    paths = _paths(tmp_path)
    write_image_folder(paths["src"], CLASSES, per_class=8, size=(32, 32))
    first = _nightly(paths)
    assert first.returncode == 0, first.stderr + "".join(p.read_text() for p in _logs(paths))
    before = load_dataset_manifest(paths["data"])
    shards_before = _stamps(paths["data"], "*.tar")
    features_before = _stamps(paths["feat"], "*.pt")
    metrics_before, _ = _latest_run(paths)

    _add_images(paths["src"], per_class=4, start=8)
    second = _nightly(paths)
    assert second.returncode == 0, second.stderr + _logs(paths)[-1].read_text()
    after = load_dataset_manifest(paths["data"])
    shards_after = _stamps(paths["data"], "*.tar")

    # Old shards untouched (same inode and mtime), new shards only for the 12 new files, counts add up.
    assert {name: shards_after[name] for name in shards_before} == shards_before
    new_shards = set(shards_after) - set(shards_before)
    assert new_shards
    assert sum(s.samples for split in after.splits.values() for s in split.shards if s.path in new_shards) == 12
    total = lambda m: sum(split.samples for split in m.splits.values())  # noqa: E731
    assert total(after) == total(before) + 12 == 36
    assert [sum(c) for c in zip(*(split.class_counts for split in after.splits.values()))] == [12, 12, 12]

    # Only the new shards were featurised; the features cover every shard.
    features = load_feature_manifest(paths["feat"])
    assert sum(split.samples for split in features.splits.values()) == 36
    features_after = _stamps(paths["feat"], "*.pt")
    assert {name: features_after[name] for name in features_before} == features_before
    assert len(features_after) == len(shards_after)

    # Training saw the new samples: more steps per epoch, and every val sample in the confusion matrix.
    metrics_after, model = _latest_run(paths)
    assert metrics_after[-1]["step"] > metrics_before[-1]["step"]
    assert sum(map(sum, metrics_after[-1]["val_confusion"])) == after.splits["val"].samples
    assert list(model["classes"]) == CLASSES
    logs = _logs(paths)
    assert len(logs) == 2 and all(log.read_text().splitlines()[-1].split(" ", 1)[1].startswith("nightly: OK")
                                  for log in logs)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_overlapping_run_exits_at_once_without_touching_anything(tmp_path):
    paths = _paths(tmp_path)
    write_image_folder(paths["src"], CLASSES, per_class=4, size=(32, 32))
    paths["logs"].mkdir()
    lock = paths["logs"] / "nightly.lock"
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # what flock(1) in a running nightly holds
        before = _tree(tmp_path)
        result = _nightly(paths)
        assert _tree(tmp_path) == before
    assert result.returncode == 0
    assert "another run holds the lock" in result.stderr
    assert not paths["data"].exists() and not _logs(paths)


@pytest.mark.slow
def test_failing_stage_exits_nonzero_and_says_so_last(tmp_path):
    paths = _paths(tmp_path)
    write_image_folder(paths["src"], CLASSES, per_class=4, size=(32, 32))
    result = _nightly(paths, "--backbone", "no_such_backbone")
    assert result.returncode != 0
    assert "FAILED at stage features" in result.stderr
    (log,) = _logs(paths)
    assert "FAILED at stage features" in log.read_text().splitlines()[-1]
    assert (paths["data"] / "dataset.json").is_file() and not (paths["runs"] / "latest").exists()
