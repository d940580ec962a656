"""The run record (``shards.runrecord``): what a run folder holds, written by training and read back by anyone
without ``train``: ``run.json`` (the loader call, versioned) and ``metrics.jsonl`` (versioned epoch rows)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from shards.check.lineage import open_train_loader, run_lineage
from shards.cli.main import main as shards_main
from shards.errors import InputError
from shards.loader.base import RunMode
from shards.loader.in_process import InProcess
from shards.runrecord import METRICS_FILE, RECORD_FILE, ROW_VERSION, RUN_VERSION, EpochRow, RunRecord, read_rows
from tests.train.configs import train_config
from train.run.lineage import read_recorded_keys
from train.run.loop import train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from tests.train.conftest import write_feature_folder

    root = tmp_path_factory.mktemp("record")
    data = write_feature_folder(root / "cache", shard_sizes={"train": [40, 30], "val": [12]}, classes=("a", "b"))
    train(train_config(str(data), str(root / "run"), epochs=2, batch_size=16,
                      workers=0, quiet=True, device="cpu", record_keys=True, seed=3))
    return root / "run"


def test_the_record_holds_the_loader_call_as_plain_values(run: Path):
    record = RunRecord.read(run)
    raw = json.loads((run / RECORD_FILE).read_text())
    assert (raw["format"], raw["version"], raw["epochs"]) == ("shardcache.run", RUN_VERSION, 2)
    call = record.data.open_dataset
    assert call["path"].endswith("features") and call["sources"] is None and call["split"] == "train"
    assert call["seed"] == 3 and call["return_keys"] is True and call["sampling"]["shuffle"] is True
    assert call["distributed"] == {"world_size": 1, "nodes": None, "rotate_every": 0}
    assert record.data.make_loader == {"batch_size": 16, "drop_last": True, "mode": {"kind": "in-process"}}
    assert RunMode.parse(record.data.run_mode) == InProcess()  # the mode's one JSON form, read back


def test_the_loader_rebuilt_from_the_record_alone_feeds_the_recorded_keys(run: Path):
    record = RunRecord.read(run)
    loader = open_train_loader(record.data, rank=0, world_size=1, nodes=1, workers=0, batch_size=16,
                               exclude_keys=None)
    recorded = read_recorded_keys(run)
    loader.set_epoch(1)
    second_epoch = [key for (epoch, _, _), keys in sorted(recorded.items(), key=lambda i: i[0][1]) if epoch == 2
                    for key in keys]
    assert [s["key"] for batch in range(len(loader)) for s in loader.batch_keys(1, batch)] == second_epoch


def test_epoch_rows_round_trip_with_their_version(run: Path):
    rows = read_rows(run / METRICS_FILE)
    assert [row.epoch for row in rows] == [1, 2] and all(row.version == ROW_VERSION for row in rows)
    assert all(isinstance(row, EpochRow) and row.val_top1 is not None and row.train_top1 is not None
               for row in rows)
    assert EpochRow(**rows[0].to_json()) == rows[0]
    assert rows[0].val_mse is None and "val_mse" not in rows[0].to_json()  # not measured: left out of the line


def copy_of(run: Path, tmp_path: Path) -> Path:
    import shutil

    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_a_record_of_another_version_is_one_line_naming_the_file(run: Path, tmp_path: Path, version):
    folder = copy_of(run, tmp_path)
    raw = json.loads((folder / RECORD_FILE).read_text())
    (folder / RECORD_FILE).write_text(json.dumps({**raw, "version": version}))
    with pytest.raises(InputError) as caught:
        RunRecord.read(folder)
    message = str(caught.value)
    assert "\n" not in message and str(folder / RECORD_FILE) in message and "version" in message
    result = CliRunner().invoke(shards_main, ["lineage", str(folder), "--epoch", "1", "--step", "1"])
    assert result.exit_code == 2 and "Traceback" not in result.output and RECORD_FILE in result.output


@pytest.mark.parametrize("change,field", [({"mode": 3}, "mode"), ({"batch_size": 2.5}, "batch_size"),
                                          ({"drop_last": "yes"}, "drop_last"), ({"surprise": 1}, "surprise")])
def test_a_record_whose_loader_call_has_another_shape_is_refused(run: Path, tmp_path: Path, change, field):
    folder = copy_of(run, tmp_path)
    raw = json.loads((folder / RECORD_FILE).read_text())
    raw["data"]["make_loader"].update(change)
    (folder / RECORD_FILE).write_text(json.dumps(raw))
    with pytest.raises(InputError, match=field) as caught:
        run_lineage(folder, 1, 1)
    assert "\n" not in str(caught.value) and str(folder / RECORD_FILE) in str(caught.value)


@pytest.mark.parametrize("line,says", [('{"epoch": 1}', "version is missing"),
                                       ('{"version": 9, "epoch": 1}', "version 9"),
                                       ('{"version": 1, "epoch": 0}', "epoch"),
                                       ('{"version": 1, "epoch": 1, "val_loss": "low"}', "val_loss"),
                                       ('{"version": 1, "epoch": 1, "mystery": 2}', "mystery")])
def test_a_malformed_epoch_row_is_one_line_naming_the_file_and_line(run: Path, tmp_path: Path, line: str, says: str):
    folder = copy_of(run, tmp_path)
    path = folder / METRICS_FILE
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(InputError) as caught:
        read_rows(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and "line 3" in message and says in message


def test_shards_lineage_imports_nothing_from_train(run: Path):
    """``shards`` depends on no other package: the lineage command and the rebuilt loader come from ``shards``."""
    code = ("import sys, json\n"
            "import shards.cli.main, shards.check.lineage\n"
            f"answer = shards.check.lineage.run_lineage({str(run)!r}, 1, 1)\n"
            "loaded = [m for m in sys.modules if m == 'train' or m.startswith('train.')]\n"
            "print(json.dumps({'loaded': loaded, 'keys': answer['ranks']['0']['keys']}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["loaded"] == []
    assert out["keys"] == read_recorded_keys(run)[(1, 1, 0)]
