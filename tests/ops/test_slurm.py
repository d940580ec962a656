"""The Slurm pipeline on a real (local, one-node) cluster: submit, chain, finish; fail a task, resubmit, resume.

Skipped only when no cluster answers (``sinfo`` fails or SLURM_CONF is unset); ``.ci/run`` starts one.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from shards.manifest import load_dataset_manifest, load_feature_manifest
from tests.helpers import write_image_folder
from tests.ops.slurm_jobs import (free_port, job_logs, job_states, queued, run_checked, slurm_reachable, submit,
                                  wait_for)

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not slurm_reachable(), reason="no Slurm cluster reachable (SLURM_CONF unset or sinfo fails)"),
]

CLASSES = ["cat", "dog", "owl"]


def _paths(tmp_path: Path) -> dict[str, Path]:
    return {name: tmp_path / name for name in ("src", "data", "feat", "run", "logs")}


def _pack_options(paths: dict[str, Path], *, max_samples: int, tasks: int) -> list[str]:
    return ["--source", str(paths["src"]), "--data-dir", str(paths["data"]), "--log-dir", str(paths["logs"]),
            "--pack-tasks", str(tasks), "--job-name", f"sc-{uuid.uuid4().hex[:6]}",
            "--pack-args", f"--shard-samples {max_samples} --val-fraction 0.25 --seed 1"]


def test_pipeline_packs_featurises_and_trains(tmp_path):
    paths = _paths(tmp_path)
    write_image_folder(paths["src"], CLASSES, per_class=8, size=(32, 32))
    ids = submit(*_pack_options(paths, max_samples=5, tasks=2),
                 "--feat-dir", str(paths["feat"]), "--run-dir", str(paths["run"]),
                 "--features-tasks", "2", "--gres", "", "--backbone", "resnet18", "--weights", "none",
                 "--features-args", "--resize 32 --crop 32 --batch-size 8 --workers 0 --device cpu",
                 "--train-args", "--head linear --epochs 2 --batch-size 8 --workers 0 --device cpu",
                 "--master-port", str(free_port()))
    assert list(ids) == ["pack", "pack_merge", "features", "features_merge", "train"]
    wait_for(list(ids.values()), timeout=200, log_dir=paths["logs"])

    states = job_states(list(ids.values()))
    assert not states or all(state == "COMPLETED" for state in states.values()), (states, job_logs(paths["logs"]))
    assert (paths["run"] / "model.pt").is_file(), job_logs(paths["logs"])
    dataset = load_dataset_manifest(paths["data"])
    assert sum(split.samples for split in dataset.splits.values()) == 24
    assert dataset.splits["val"].samples == 6
    features = load_feature_manifest(paths["feat"])
    assert [s.source for s in features.splits["train"].shards] == [s.path for s in dataset.splits["train"].shards]
    assert features.splits["train"].samples == dataset.splits["train"].samples
    model = torch.load(paths["run"] / "model.pt", weights_only=True, map_location="cpu")
    assert list(model["classes"]) == CLASSES
    metrics = [json.loads(line) for line in (paths["run"] / "metrics.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in metrics][-1] >= 1 and len(metrics) == 2
    # Every stage ran as its own Slurm job, the arrays as one task per subset.
    logs = {p.name.split("-", 2)[-1] for p in paths["logs"].glob("*.out")}
    assert any(name.startswith("pack_") for name in logs) and any(name.startswith("train") for name in logs)


def _shard_stamps(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.glob("*.tar")}


def test_resubmission_packs_only_what_the_cancelled_task_left(tmp_path):
    paths = _paths(tmp_path)
    write_image_folder(paths["src"], CLASSES, per_class=8, size=(32, 32))
    options = _pack_options(paths, max_samples=3, tasks=3) + ["--stages", "pack"]
    # Held at submission, so task 1 is cancelled before it can start: deterministic, no race with the others.
    first = submit(*options, "--pack-sbatch-args", "--hold")
    array = first["pack"]
    run_checked(["scancel", f"{array}_1"])
    run_checked(["scontrol", "release", array])
    wait_for(list(first.values()), timeout=120, log_dir=paths["logs"])

    assert not (paths["data"] / "dataset.json").exists(), "the merge must not run after a cancelled task"
    done_first = _shard_stamps(paths["data"])
    assert done_first, job_logs(paths["logs"])
    states = job_states([array])
    assert states.get(f"{array}_1", "CANCELLED") == "CANCELLED", states  # never started: sacct may omit it

    second = submit(*options)
    wait_for(list(second.values()), timeout=120, log_dir=paths["logs"])
    dataset = load_dataset_manifest(paths["data"])
    packed = {s.path for split in dataset.splits.values() for s in split.shards}
    assert sum(split.samples for split in dataset.splits.values()) == 24
    assert set(done_first) < packed, "the resubmission must add the cancelled task's shards"
    after = _shard_stamps(paths["data"])
    assert {name: after[name] for name in done_first} == done_first, "finished shards were rewritten"
    assert not queued(list(first.values()) + list(second.values()))
