"""``--memory-budget`` (``shards.loader.budget``) in training and precomputing: one option for both commands, the
default shared by the ranks of a node, the S3 read-ahead sized from it, and the budget stated in ``run.json`` and
precompute's summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from preprocess.features.cli import precompute_features_command
from shards.errors import InputError
from shards.loader.budget import MemoryBudget, read_ahead_within
from shards.runrecord import RECORD_FILE, RunRecord
from shards.transport.s3 import S3Options
from tests.train.configs import train_config
from train.api import train_config as cli_config
from train.cli import train_command
from train.distributed import DistContext
from train.memory import loader_budget
from train.options import LoaderOptions

MIB = 1 << 20


def _ctx(local: int) -> DistContext:
    return DistContext(rank=0, world_size=local, local_rank=0, device=torch.device("cpu"), owns_group=False,
                       local_world_size=local)


@pytest.mark.parametrize("command", [train_command, precompute_features_command])
def test_both_commands_take_one_memory_budget_option(command):
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0 and "--memory-budget SIZE" in result.output


def test_the_option_lands_in_the_loader_group_and_nonsense_is_refused(tmp_path):
    cfg = cli_config(str(tmp_path), out=tmp_path / "run", memory_budget=2 << 30)
    assert cfg.loader.memory_budget == 2 << 30
    with pytest.raises(InputError, match="loader.memory_budget=0 must be a positive integer"):
        LoaderOptions(memory_budget=0)


def test_the_default_is_shared_by_the_ranks_on_the_node(tmp_path):
    cfg = train_config(tmp_path, tmp_path / "run", workers=0)
    alone, four = loader_budget(cfg, _ctx(1), "features"), loader_budget(cfg, _ctx(4), "features")
    assert four.record["ranks_on_node"] == 4 and "/ 4 rank(s)" in four.budget.source
    assert abs(four.budget.limit * 4 - alone.budget.limit) < 64 * MIB  # the same memory left, a quarter each
    given = loader_budget(train_config(tmp_path, tmp_path / "run", memory_budget=64 * MIB), _ctx(4), "features")
    assert given.budget == MemoryBudget(64 * MIB) and given.record["source"] == "given"
    assert given.storage_options is None and given.record["read_ahead_bytes_per_process"] is None  # local data


def test_s3_read_ahead_is_sized_from_the_budget_per_worker_process(tmp_path):
    cfg = train_config(tmp_path, tmp_path / "run", memory_budget=64 * MIB, workers=4,
                       storage_options=S3Options().to_dict())
    sized = loader_budget(cfg, _ctx(1), "images")
    assert sized.storage_options["read_ahead_bytes"] == 4 * MIB == read_ahead_within(MemoryBudget(64 * MIB), 4,
                                                                                     64 * MIB)
    assert sized.record["reading_processes"] == 4 and sized.record["read_ahead_bytes_per_process"] == 4 * MIB


def test_precompute_sizes_its_workers_read_ahead_from_the_budget(tmp_path):
    from preprocess.features.featurize import FeatureConfig, budgeted_options

    cfg = FeatureConfig(data_dir="s3://bucket/photos", out_dir=str(tmp_path / "feat"), workers=2,
                        storage_options=S3Options(), memory_budget=32 * MIB)
    assert budgeted_options(cfg, MemoryBudget(32 * MIB)).read_ahead_bytes == 4 * MIB
    with pytest.raises(InputError, match="memory_budget 0 must be a positive"):
        FeatureConfig(data_dir=str(tmp_path), out_dir=str(tmp_path / "feat"), memory_budget=0)


@pytest.mark.slow
def test_run_json_states_the_budget_and_a_too_small_one_is_one_line(tmp_path):
    from tests.train.conftest import write_feature_folder

    data = write_feature_folder(tmp_path / "cache", shard_sizes={"train": [40, 30], "val": [12]}, classes=("a", "b"))
    args = [str(data), "--epochs", "1", "--batch-size", "16", "--workers", "0", "--quiet", "--device", "cpu"]
    result = CliRunner().invoke(train_command, [*args, "--out", str(tmp_path / "run"), "--memory-budget", "64M"])
    assert result.exit_code == 0, result.output
    record = RunRecord.read(tmp_path / "run")
    assert record.memory_budget["bytes"] == 64 * MIB and record.memory_budget["source"] == "given"
    assert "memory_budget" not in json.dumps(record.data.to_json())  # steering: beside the data call, not in it
    small = CliRunner().invoke(train_command, [*args, "--out", str(tmp_path / "small"), "--memory-budget", "1K"])
    assert small.exit_code != 0 and "smallest that works is" in small.output
    assert "Traceback" not in small.output and not (Path(tmp_path / "small") / RECORD_FILE).exists()


@pytest.mark.slow
def test_precompute_states_its_budget_in_the_summary(tmp_path):
    from preprocess.features.featurize import FeatureConfig, run_precompute
    from tests.helpers import make_shard_dataset

    make_shard_dataset(tmp_path / "data", shard_sizes={"train": [6]}, size=(32, 32))
    cfg = FeatureConfig(data_dir=tmp_path / "data", out_dir=tmp_path / "feat", backbone="resnet18", weights="none",
                        resize=32, crop=32, batch_size=4, workers=0, device="cpu", quiet=True,
                        memory_budget=16 * MIB)
    _, summary = run_precompute(cfg)
    assert summary["memory_budget"] == {"bytes": 16 * MIB, "source": "given", "share": None, "ranks_on_node": 1,
                                        "read_ahead_bytes_per_process": None}
