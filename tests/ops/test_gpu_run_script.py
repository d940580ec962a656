"""The one-shot GPU run's two scripts (docs/gpu.md, issue 45) are ready before a GPU sees them: they parse, are
executable, and refuse a call that lacks what they need instead of half running. The end-to-end pass on the CPU
(``--quick --device cpu``, minutes) is run by hand before a lent run, as docs/gpu.md says."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.docs.blocks import ROOT

SCRIPTS = [ROOT / "scripts" / "bench" / name for name in ("gpu_wheels.sh", "gpu_run.sh")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_is_executable_and_parses(script):
    assert os.access(script, os.X_OK)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_run_refuses_to_start_without_a_folder_for_its_results():
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    result = subprocess.run(["bash", str(SCRIPTS[1])], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode != 0 and "OUT" in result.stderr


def test_the_wheels_script_refuses_an_unknown_argument_before_fetching_anything():
    result = subprocess.run(["bash", str(SCRIPTS[0]), "--after"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "usage" in result.stderr
