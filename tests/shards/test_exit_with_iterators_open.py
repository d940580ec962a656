"""A script that leaves an iteration unfinished and ends (``x, y = next(iter(loader))``, a second loader zipped with a
shorter one) exits quietly with code 0 in every mode: loader threads were still inside torch at exit, which aborted
the process ("terminate called without an active exception", 134), and generators closed during module teardown
printed "Exception ignored ... TypeError"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_shard_dataset

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, shards
dataset = shards.open_dataset(sys.argv[1], "train", transform="eval", seed=0)
if sys.argv[2] == "dataset":
    sample = next(iter(dataset))
else:
    loader = shards.make_loader(dataset, batch_size=4, mode=sys.argv[2])
    images, labels = next(iter(loader))
print("ok")
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("open_at_exit")
    make_shard_dataset(root, shard_sizes={"train": [20, 20]}, size=(48, 48))
    return root


@pytest.mark.slow  # one interpreter per mode, each starting torch
@pytest.mark.parametrize("mode", ["threads:2", "threads:2,decoders=2", "processes:2", "0", "dataset"])
def test_an_unfinished_iteration_at_exit_ends_quietly(folder, mode):
    for _ in range(2):  # the abort came most runs, not every run
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(folder), mode], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")


GROUP_SIGTERM = """
import os, subprocess, sys, shards
from shards.jobs.preemption import stop_signals

dataset = shards.open_dataset(sys.argv[1], "train", transform="eval", seed=0)
loader = shards.make_loader(dataset, batch_size=4, num_workers=2, drop_last=False)
with stop_signals("the test") as stop:
    batches = 0
    for images, labels in loader:
        if batches == 0:
            # What Slurm and Kubernetes send, from a process of their own: SIGTERM to every process of the job.
            subprocess.run(["kill", "-s", "TERM", "--", f"-{os.getpgid(0)}"])  # kill is one of them
        batches += 1
print(batches, stop.signal_name)
"""


@pytest.mark.slow  # a fresh interpreter and its worker processes
def test_workers_outlive_a_sigterm_sent_to_every_process_of_the_job(folder):
    """The main process saves its place and stops its workers itself; torch's worker handler killed them first,
    and the command ended in "DataLoader worker ... is killed by signal: Terminated" (exit 1, not 75)."""
    done = subprocess.run([sys.executable, "-c", GROUP_SIGTERM, str(folder)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, start_new_session=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["10", "SIGTERM"]  # 40 samples in batches of 4: the epoch went on whole
