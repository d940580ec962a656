"""The Slurm templates' preemption contract, without a cluster: a stand-in srun and scontrol on PATH. The time-limit
signal (USR1 to the batch shell) reaches the step as SIGTERM; a step that exits 75 is requeued, and the requeued
job continues with --resume instead of --overwrite."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The step: records its arguments, then waits; SIGTERM makes it exit 75, as train-from-shards does after saving.
FAKE_SRUN = """#!/usr/bin/env bash
echo "$@" > "$FAKE_LOG/args"
trap 'echo TERM >> "$FAKE_LOG/signals"; exit 75' TERM
touch "$FAKE_LOG/started"
for _ in $(seq 100); do sleep 0.1; done
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
if [ "$1" = show ]; then echo node1; else echo "$@" >> "$FAKE_LOG/scontrol"; fi
"""


def run_template(tmp_path: Path, *, restart: int, sig: int | None) -> tuple[int, Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1", "SLURM_RESTART_COUNT": str(restart),
           "SHARDCACHE_VENV": "/venv", "SHARDCACHE_NPROC_PER_NODE": "1", "SHARDCACHE_MASTER_PORT": "29500",
           "SHARDCACHE_CACHE_DIR": ""}
    process = subprocess.Popen(["bash", str(ROOT / "scripts/slurm/train.sbatch"), "FEAT", "--out", "RUN",
                                "--overwrite"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while not (log / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    if sig is not None:
        process.send_signal(sig)
    process.communicate(timeout=30)
    return process.returncode, log


def test_the_time_limit_signal_stops_the_step_and_requeues_the_job(tmp_path):
    rc, log = run_template(tmp_path, restart=0, sig=signal.SIGUSR1)
    assert rc == 75
    assert (log / "signals").read_text() == "TERM\n"
    assert (log / "scontrol").read_text() == "requeue 42\n"
    assert (log / "args").read_text().split()[-4:] == ["FEAT", "--out", "RUN", "--overwrite"]


def test_a_requeued_job_resumes_and_a_cancel_is_not_requeued(tmp_path):
    rc, log = run_template(tmp_path, restart=1, sig=signal.SIGTERM)
    assert rc == 75 and not (log / "scontrol").exists()  # scancel or Slurm's own preemption: no requeue from here
    assert (log / "args").read_text().split()[-4:] == ["FEAT", "--out", "RUN", "--resume"]
