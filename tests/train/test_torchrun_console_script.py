"""The README's DDP line, ``torchrun --no-python train-from-shards ...``, from a folder holding a user's own
``train.py`` and data folders named ``shards/`` and ``train/``: two gloo ranks train, and the user's file never runs
(``torchrun -m train`` would import it: the working directory comes first on ``sys.path``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 240  # a hang fails the test instead of blocking the suite


def test_torchrun_no_python_starts_the_console_script_not_a_users_train_py(feature_folder: Path, tmp_path: Path):
    work = tmp_path / "project"
    (work / "shards").mkdir(parents=True)
    (work / "train").mkdir()
    (work / "train.py").write_text("raise SystemExit('the user train.py ran')\n", encoding="utf-8")
    bin_dir = Path(sys.executable).parent
    command = [str(bin_dir / "torchrun"), "--standalone", "--nproc_per_node=2", "--no-python", "train-from-shards",
               str(feature_folder), "--out", str(tmp_path / "run"), "--epochs", "1", "--batch-size", "16",
               "--device", "cpu", "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)  # the installed package, as a user's shell has it
    result = subprocess.run(command, cwd=work, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the user train.py ran" not in result.stderr
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1 and summaries[0]["world_size"] == 2
