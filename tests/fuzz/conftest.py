"""The fuzz suite's Hypothesis profile and its artifacts.

``SHARDCACHE_FUZZ_PROFILE`` picks the profile (``tests/fuzz/engine.py``): ``ci`` by default (derandomized, about 2
minutes for the whole suite), ``long`` under ``scripts/fuzz``. The valid artifacts every target mutates are built
once per session (in memory when ``/dev/shm`` exists), and the heavy libraries are imported before the first reader
is forked, so each child starts with them loaded.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import settings

from tests.fuzz.engine import profile_name, scratch_dir
from tests.fuzz.seeds import Seeds

settings.load_profile(profile_name())


@pytest.fixture(scope="session")
def seeds() -> Iterator[Seeds]:
    import h5py  # noqa: F401
    import pyarrow.ipc  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    import torch  # noqa: F401

    import shards.report.build  # noqa: F401
    import shards.stream.reader  # noqa: F401
    import shards.check.lineage  # noqa: F401

    root = Path(tempfile.mkdtemp(prefix="shardcache-fuzz-seeds-", dir=scratch_dir()))
    yield Seeds(root)
    shutil.rmtree(root, ignore_errors=True)
