"""Loader and decode threads run torch's kernels on one thread each, and leave the training thread's count alone:
torch hands a thread that has not run torch yet the count last set anywhere, so the loader threads' 1 made the whole
training step of ``--run-mode threads`` run on one core (another model than processes gave, and an inexact resume)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_shard_dataset

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import sys, threading, torch, shards

seen = []
def transform(image):
    if threading.current_thread() is not threading.main_thread():  # not Threads' probe of the transform, which
        seen.append(torch.get_num_threads())  # runs it here: asking would fix this thread's count before the loader
    return 0

dataset = shards.open_dataset(sys.argv[1], "train", transform=transform, seed=0)
loader = shards.make_loader(dataset, batch_size=4, mode=sys.argv[2])
batches = sum(1 for _ in loader)
print(batches, torch.get_num_threads(), sorted(set(seen)))
"""


@pytest.mark.slow  # an interpreter per mode
@pytest.mark.parametrize("mode", ["threads:2", "threads:2,decoders=2"])
def test_the_training_thread_keeps_its_count_and_loader_threads_run_one(tmp_path, mode):
    make_shard_dataset(tmp_path / "ds", shard_sizes={"train": [6, 6]}, size=(16, 16))
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # a count other than 1 (torch keeps it within the cores)
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, timeout=60, env=env)
    assert int(default.stdout) == 2  # what the training thread must keep (the machine has 2 cores or more)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ds"), mode], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    batches, main_count, loader_counts = done.stdout.split(maxsplit=2)
    assert int(batches) == 3 and int(main_count) == 2 and loader_counts.strip() == "[1]"
