"""Submitting and waiting for Slurm jobs from tests (the cluster is the one ``.ci/run`` starts)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBMIT = ROOT / "scripts" / "slurm" / "submit-pipeline"
VENV = Path(sys.executable).parent.parent
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


def slurm_reachable() -> bool:
    """True when ``sinfo`` answers: SLURM_CONF names a running cluster."""
    if not os.environ.get("SLURM_CONF") or shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def submit(*args: str) -> dict[str, str]:
    """Run submit-pipeline; return its job ids by stage."""
    result = subprocess.run(["bash", str(SUBMIT), "--venv", str(VENV), *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_checked(argv: list[str]) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"{argv}: {result.stderr}"


def queued(job_ids: list[str]) -> list[str]:
    """The lines squeue still shows for these jobs (array tasks included)."""
    result = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T"], capture_output=True,
                            text=True, timeout=30)
    return [line for line in result.stdout.splitlines() if line.strip()]


def wait_for(job_ids: list[str], timeout: float, log_dir: Path) -> None:
    """Poll squeue until none of the jobs is pending or running; on timeout, fail with the job logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not queued(job_ids):
            return
        time.sleep(1.0)
    subprocess.run(["scancel", *job_ids], timeout=30)
    raise AssertionError(f"jobs {job_ids} still queued after {timeout} s: {queued(job_ids)}\n{job_logs(log_dir)}")


def job_states(job_ids: list[str], timeout: float = 30) -> dict[str, str]:
    """JobID (array tasks as 12_3) -> final state, from accounting (empty when sacct is unavailable).

    Accounting lags the queue by a moment, so this polls until every state it reports is final.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = subprocess.run(["sacct", "-n", "-X", "-P", "-j", ",".join(job_ids), "-o", "JobID,State"],
                                capture_output=True, text=True, timeout=30)
        states = {}
        for line in result.stdout.splitlines():
            if "|" in line:
                job, state = line.split("|", 1)
                states[job] = state.split()[0] if state else ""
        if all(state in FINAL_STATES for state in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


def job_logs(log_dir: Path) -> str:
    """Every job log, for failure messages."""
    if not log_dir.is_dir():
        return "(no job logs)"
    return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(log_dir.glob("*.out")))
