"""Task indices from a Kubernetes Indexed Job (``JOB_COMPLETION_INDEX`` plus a count) beside Slurm arrays.

Kubernetes gives each pod its index but no count, so the count comes from ``--num-tasks`` or
``SHARDCACHE_NUM_TASKS``; an index without a count, or two schedulers that disagree, is one line and exit 2.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from preprocess.features.cli import precompute_features_command
from preprocess.pack.cli import pack_shards_command
from shards.cli.common import scheduler_task
from shards.errors import InputError
from tests.helpers import write_image_folder

SCHEDULER_VARIABLES = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
                       "JOB_COMPLETION_INDEX", "SHARDCACHE_NUM_TASKS")


@pytest.fixture(autouse=True)
def no_scheduler(monkeypatch):
    """Each test states the scheduler it runs under (the machine running the suite may be a Slurm job)."""
    for name in SCHEDULER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def pack(args, env=None):
    return CliRunner().invoke(pack_shards_command, [str(a) for a in args], env=env)


def error_lines(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("env, options, expected", [
    ({}, (None, None), (0, 1)),
    ({"JOB_COMPLETION_INDEX": "2", "SHARDCACHE_NUM_TASKS": "4"}, (None, None), (2, 4)),
    ({"JOB_COMPLETION_INDEX": "2"}, (None, 3), (2, 3)),
    ({"JOB_COMPLETION_INDEX": "2", "SHARDCACHE_NUM_TASKS": "4"}, (1, 2), (1, 2)),  # options win
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_COUNT": "4"}, (None, None), (2, 4)),
    # A Slurm array inside Kubernetes: both schedulers set and agreeing is fine.
    ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "JOB_COMPLETION_INDEX": "1",
      "SHARDCACHE_NUM_TASKS": "2"}, (None, None), (1, 2)),
    ({"SLURM_ARRAY_TASK_ID": "1", "JOB_COMPLETION_INDEX": "0"}, (0, 2), (0, 2)),  # --task-index settles it
])
def test_where_index_and_count_come_from(monkeypatch, env, options, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert scheduler_task(*options) == expected


@pytest.mark.parametrize("env, options, message", [
    ({"JOB_COMPLETION_INDEX": "0"}, (None, None), "JOB_COMPLETION_INDEX is set"),
    ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "JOB_COMPLETION_INDEX": "0"}, (None, None),
     "the task index is ambiguous (SLURM_ARRAY_TASK_ID=1, JOB_COMPLETION_INDEX=0)"),
    ({"SLURM_ARRAY_TASK_COUNT": "2", "SHARDCACHE_NUM_TASKS": "3"}, (None, None),
     "the task count is ambiguous (SLURM_ARRAY_TASK_COUNT=2, SHARDCACHE_NUM_TASKS=3); pass --num-tasks"),
    ({"JOB_COMPLETION_INDEX": "4", "SHARDCACHE_NUM_TASKS": "4"}, (None, None), "task index 4 is not in [0, 4)"),
    ({"JOB_COMPLETION_INDEX": "one", "SHARDCACHE_NUM_TASKS": "4"}, (None, None), "is not an integer"),
])
def test_what_is_refused(monkeypatch, env, options, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InputError) as caught:
        scheduler_task(*options)
    assert message in str(caught.value)


def test_an_indexed_job_packs_its_part_and_the_merge_finishes(tmp_path):
    write_image_folder(tmp_path / "src", ["a", "b"], 4, size=(16, 16))
    args = [tmp_path / "src", "--out", tmp_path / "out", "--shard-samples", "2", "-q"]
    first = pack(args, env={"JOB_COMPLETION_INDEX": "1", "SHARDCACHE_NUM_TASKS": "2"})
    assert first.exit_code == 0, first.output
    summary = json.loads(first.stdout)
    assert (summary["task_index"], summary["num_tasks"], summary["complete"]) == (1, 2, False)
    second = pack(args + ["--num-tasks", "2"], env={"JOB_COMPLETION_INDEX": "0"})
    assert second.exit_code == 0, second.output
    assert json.loads(second.stdout)["complete"] is True
    merged = pack(["--merge", tmp_path / "out", "-q"])
    assert merged.exit_code == 0 and json.loads(merged.stdout)["samples"] == 8


def test_an_index_without_a_count_exits_2_before_any_work(tmp_path):
    write_image_folder(tmp_path / "src", ["a", "b"], 2, size=(16, 16))
    result = pack([tmp_path / "src", "--out", tmp_path / "out", "-q"], env={"JOB_COMPLETION_INDEX": "0"})
    assert result.exit_code == 2
    assert len(error_lines(result)) == 1 and "SHARDCACHE_NUM_TASKS" in error_lines(result)[0]
    assert not (tmp_path / "out").exists()
    features = CliRunner().invoke(precompute_features_command, [str(tmp_path / "src"), "--out", str(tmp_path / "f")],
                                  env={"JOB_COMPLETION_INDEX": "3"})
    assert features.exit_code == 2 and "--num-tasks" in error_lines(features)[0]
    assert not (tmp_path / "f").exists()


def test_schedulers_that_disagree_exit_2(tmp_path):
    write_image_folder(tmp_path / "src", ["a", "b"], 2, size=(16, 16))
    result = pack([tmp_path / "src", "--out", tmp_path / "out", "-q"],
                  env={"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "2", "JOB_COMPLETION_INDEX": "1"})
    assert result.exit_code == 2 and "ambiguous" in error_lines(result)[0]
    assert not (tmp_path / "out").exists()
