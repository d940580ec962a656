"""Folders of every kind a report reads: a packed-like image dataset, a feature cache, and a trained run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shards.runrecord import ROW_VERSION

from tests.helpers import colour_shards
from tests.train.conftest import write_feature_folder

CLASSES = ("ant", "bee", "cat", "dog")


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    """3 colour-coded classes of real JPEGs in uneven tar shards."""
    return colour_shards(tmp_path / "images", size=(40, 32))


@pytest.fixture
def feature_dir(tmp_path: Path) -> Path:
    return write_feature_folder(tmp_path / "cache", shard_sizes={"train": [40, 30], "val": [24]}, classes=CLASSES)


@pytest.fixture(scope="session")
def trained_root(tmp_path_factory) -> Path:
    """A 2-epoch linear-head run on a feature cache (``ROOT/run``, ``ROOT/cache/{features,dataset}``), trained once;
    tests that change it work on a copy (``run_copy``)."""
    from tests.train.configs import train_config
    from train.run.loop import train

    root = tmp_path_factory.mktemp("trained")
    features = write_feature_folder(root / "cache", shard_sizes={"train": [40, 30], "val": [24]}, classes=CLASSES)
    train(train_config(str(features), str(root / "run"), epochs=2, batch_size=16, quiet=True,
                      device="cpu"))
    return root


@pytest.fixture
def run_copy(trained_root: Path, tmp_path: Path) -> Path:
    """A private copy of the trained run; its config still names the shared feature cache."""
    target = tmp_path / "run"
    shutil.copytree(trained_root / "run", target)
    return target


def read_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def write_rows(run: Path, rows: list[dict]) -> None:
    """``rows`` as a run writes them: each an ``EpochRow`` of this version unless the row names its own."""
    (run / "metrics.jsonl").write_text("".join(json.dumps({"version": ROW_VERSION, **row}, sort_keys=True) + "\n"
                                               for row in rows))
