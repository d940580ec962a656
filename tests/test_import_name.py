"""A user's data folders named like our packages cannot hide them.

``python -c`` and ``python -m`` put the working directory first on ``sys.path``, and a folder without
``__init__.py`` there is a namespace package to Python. With setuptools' default editable hook (asked after
``sys.path``'s finder) ``import shards`` from a folder holding a ``shards/`` data folder gave that empty namespace:
"module 'shards' has no attribute 'open_dataset'". The install puts the checkout on ``sys.path`` instead
(pyproject.toml, ``package-dir``), where a regular package wins over a namespace folder wherever it sits. Run with
the venv's own Python, from such a folder, as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shards", "preprocess", "train")

pytestmark = pytest.mark.slow  # each check starts a Python that imports torch (1-3 s)


@pytest.fixture
def data_folders(tmp_path: Path) -> Path:
    """A working directory holding data folders ``shards/``, ``train/``, ``preprocess/`` (files, no __init__.py)."""
    for name in PACKAGES:
        (tmp_path / name).mkdir()
        (tmp_path / name / "dataset.json").write_text("{}", encoding="utf-8")
    return tmp_path


def _user_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # as a user's shell has it: only the install says where the packages are
    return env


def test_python_c_imports_our_packages_beside_same_named_data_folders(data_folders: Path):
    code = ("import shards, train, preprocess\n"
            "print(shards.open_dataset.__module__)\n"
            "for m in (shards, preprocess, train): print(m.__file__)")
    result = subprocess.run([sys.executable, "-c", code], cwd=data_folders, capture_output=True, text=True,
                            timeout=120, env=_user_env())
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("shards.")
    assert [Path(line).parent.name for line in lines[1:]] == list(PACKAGES)
    assert not any(Path(line).is_relative_to(data_folders) for line in lines[1:])


def test_console_script_runs_beside_same_named_data_folders(data_folders: Path):
    script = Path(sys.executable).parent / "shards"
    result = subprocess.run([str(script), "--help"], cwd=data_folders, capture_output=True, text=True, timeout=120,
                            env=_user_env())
    assert result.returncode == 0, result.stderr[-2000:]
    assert "verify" in result.stdout
