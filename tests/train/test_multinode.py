"""Two "nodes" on one machine: two torchrun launchers (c10d rendezvous on 127.0.0.1, 2 processes each), each with
its own node-local shard cache, end with the same metrics as one node of 4 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.s3.server import free_ports
from shards.runrecord import read_rows

TIMEOUT_S = 300
ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["-m", "train", "--epochs", "2", "--batch-size", "8", "--device", "cpu", "--quiet"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "SHARDCACHE_CACHE_DIR"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def _summary(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_two_nodes_of_two_match_one_node_of_four_and_each_node_fetches_once(feature_folder: Path, tmp_path: Path):
    data = str(feature_folder)
    single = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", *TRAIN,
         data, "--out", str(tmp_path / "one-node")],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=_env())
    assert single.returncode == 0, single.stderr[-3000:]

    (port,) = free_ports(1)
    launchers = []
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                   "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=shardcache-test",
                   f"--node_rank={node}", "--max_restarts=0", *TRAIN, data, "--out", str(tmp_path / "two-nodes"),
                   "--cache-local"]
        env = _env(SHARDCACHE_CACHE_DIR=str(tmp_path / f"node{node}-cache"))  # each node's local scratch
        launchers.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=env))
    outputs = [p.communicate(timeout=TIMEOUT_S) for p in launchers]
    for process, (_, stderr) in zip(launchers, outputs):
        assert process.returncode == 0, stderr[-3000:]
    (one,), (two,) = _summary(single.stdout), [s for out, _ in outputs for s in _summary(out)]
    assert one["world_size"] == two["world_size"] == 4
    assert two["steps"] == one["steps"]
    for name in ("train_loss", "val_loss", "val_top1"):
        assert two[name] == pytest.approx(one[name], abs=1e-6), name

    # Each node's cache holds each shard it read once (keyed by sha256), and no partial files.
    feature_bytes = {p.name: p.stat().st_size for p in feature_folder.glob("*.pt")}
    for node in range(2):
        cached = [p for p in (tmp_path / f"node{node}-cache").rglob("*.pt") if p.is_file()]
        assert cached, f"node {node} cached nothing"
        assert len(cached) <= len(feature_bytes)
        assert not list((tmp_path / f"node{node}-cache").rglob("*.tmp"))
    rows = [row.to_json() for row in read_rows(tmp_path / "two-nodes" / "metrics.jsonl")]
    # Epoch 1 fetched each shard at most once per node (two ranks, one download); epoch 2 fetched nothing.
    assert 0 < rows[0]["fetched_bytes"] <= 2 * sum(feature_bytes.values())
    assert rows[0]["cache"]["misses"] <= 2 * len(feature_bytes)
    assert rows[1]["fetched_bytes"] == 0
