"""``shards verify --workers N``: shards checked in worker processes give the report one process gives (the same
problems in the same order, the same counts and exit code), for image datasets and feature folders."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shards.check.features_verify import verify_feature_folder
from shards.check.verify import verify_dataset
from shards.cli.main import main
from shards.formats.features import FeatureShard, write_feature_shard
from shards.formats.sample import RawSample
from shards.transport.storage import STORAGES
from shards.jobs.parallel import ordered_map
from tests.helpers import class_image, make_shard_dataset
from tests.shards.test_features_verify import _feature_folder


def _indexed_dataset(folder: Path) -> Path:
    """Eight tar shards with their per-sample index recorded in dataset.json (as pack-shards records it)."""
    make_shard_dataset(folder, shard_sizes={"train": [5, 4, 6, 3, 5, 4], "val": [4, 3]})
    manifest = json.loads((folder / "dataset.json").read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            index = folder / (shard["path"] + ".idx")
            shard["index"] = index.name
            shard["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    (folder / "dataset.json").write_text(json.dumps(manifest))
    return folder


def _rewrite(folder: Path, name: str, change) -> None:
    """Rewrite shard ``name`` with ``change(samples)`` and record its new bytes in dataset.json (damage that only
    reading the samples finds)."""
    samples = change(list(STORAGES["tar"].read(folder / name)))
    with STORAGES["tar"].writer(folder / name) as writer:
        for sample in samples:
            writer.write(sample)
    manifest = json.loads((folder / "dataset.json").read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            if shard["path"] == name:
                shard.update(bytes=writer.bytes, sha256=writer.sha256, samples=len(samples),
                             index_sha256=hashlib.sha256((folder / (name + ".idx")).read_bytes()).hexdigest())
    (folder / "dataset.json").write_text(json.dumps(manifest))


def damaged_dataset(folder: Path) -> Path:
    """Every kind of shard damage at once, spread over the shards: a flipped byte, a truncated shard, a label out
    of range, a missing shard, a missing sidecar, keys that repeat one in an earlier shard, an undecodable image."""
    _indexed_dataset(folder)
    _rewrite(folder, "train-000001.tar", lambda s: s[:2] + [s[2]._replace(label=7)] + s[3:])
    _rewrite(folder, "train-000004.tar", lambda s: [s[0]._replace(key="train_00001")] + s[1:3]
             + [s[3]._replace(key="train_00006", data=class_image(0, 3)[:200])] + s[4:])
    _rewrite(folder, "val-000001.tar", lambda s: s + [RawSample("val_00000", class_image(1, 9), "jpg", 1, b"{}")])
    data = bytearray((folder / "train-000000.tar").read_bytes())
    data[len(data) // 3] ^= 0x01
    (folder / "train-000000.tar").write_bytes(bytes(data))
    (folder / "train-000002.tar").write_bytes((folder / "train-000002.tar").read_bytes()[:3000])
    (folder / "train-000003.tar").unlink()
    (folder / "train-000005.tar.idx").unlink()
    return folder


@pytest.mark.slow  # over half a second in the quick loop
def test_parallel_report_is_the_serial_report_for_damaged_images(tmp_path):
    folder = damaged_dataset(tmp_path / "data")
    serial = verify_dataset(folder, full=True, workers=1)
    problems = serial.problems
    assert any(p.startswith("train-000000.tar: sha256") for p in problems)
    assert any(p.startswith("train-000002.tar: size") for p in problems)
    assert "train-000001.tar [sample train_00007]: label 7 is outside [0, 3)" in problems
    assert "train-000003.tar: missing" in problems
    assert "train-000005.tar.idx: missing (the manifest names it)" in problems
    assert "train-000004.tar [sample train_00001]: key also in train-000000.tar" in problems
    assert "train-000004.tar [sample train_00006]: key also in train-000001.tar" in problems
    assert "val-000001.tar [sample val_00000]: key also in val-000000.tar" in problems
    assert any(p.startswith("train-000004.tar [sample train_00006]: image does not decode") for p in problems)
    assert verify_dataset(folder, full=True, workers=3) == serial  # two workers: the line below
    assert verify_dataset(folder, samples_per_shard=1, workers=2) == verify_dataset(folder, samples_per_shard=1)


def test_the_cli_prints_the_same_report_with_workers(tmp_path):
    folder = damaged_dataset(tmp_path / "data")
    serial, parallel = (CliRunner().invoke(main, ["verify", str(folder), "--quiet", "--workers", n])
                        for n in ("1", "2"))
    assert serial.exit_code == parallel.exit_code == 1
    assert serial.stdout == parallel.stdout
    # Only the error lines: a worker's log warnings go to the real stderr, not to the runner's capture.
    errors = [[line for line in r.stderr.splitlines() if line.startswith("error:")] for r in (serial, parallel)]
    assert errors[0] == errors[1] and len(errors[0]) > 10
    assert "error: train-000003.tar: missing" in parallel.stderr.splitlines()


def test_the_progress_bar_counts_shards(tmp_path):
    folder = _indexed_dataset(tmp_path / "data")
    result = CliRunner().invoke(main, ["verify", str(folder), "--workers", "2"])
    assert result.exit_code == 0 and "8/8" in result.stderr and "shard/s" in result.stderr
    quiet = CliRunner().invoke(main, ["verify", str(folder), "--workers", "2", "--quiet"])
    assert quiet.exit_code == 0 and quiet.stderr == ""


def test_negative_workers_are_refused_and_zero_checks_in_process(tmp_path):
    # --workers 0 means "in this process", as in every command (shards.cli.common.default_workers).
    folder = _indexed_dataset(tmp_path / "data")
    result = CliRunner().invoke(main, ["verify", str(folder), "--workers", "-3"])
    assert result.exit_code == 2 and "--workers" in result.stderr and "-3" in result.stderr
    assert CliRunner().invoke(main, ["verify", str(folder), "--workers", "0", "--quiet"]).exit_code == 0


def test_parallel_feature_report_is_the_serial_one(tmp_path):
    folder = _feature_folder(tmp_path, shard_sizes={"train": [3, 4, 2, 5], "val": [2, 3]},
                             keys_of=lambda keys: keys[:-1] + ["other"] if keys[0] == "train_00007" else keys)
    (folder / "train-000000.pt").unlink()
    damaged = bytearray((folder / "val-000000.pt").read_bytes())
    damaged[-30] ^= 0xFF
    (folder / "val-000000.pt").write_bytes(bytes(damaged))
    write_feature_shard(folder / "val-000001.pt", FeatureShard(torch.zeros(3, 8).half(),
                                                               torch.zeros(3, dtype=torch.int64), ["a", "b", "c"]),
                        "pt")
    (tmp_path / "data" / "train-000003.tar").unlink()
    serial = verify_feature_folder(folder, full=True, workers=1)
    assert any("train-000000.pt: feature shard missing" in p for p in serial)
    assert any("val-000000.pt: sha256" in p for p in serial)
    assert any("train-000002.pt [sample other]: keys differ" in p for p in serial)
    assert any("train-000003.pt: cannot check keys" in p for p in serial)
    assert verify_feature_folder(folder, full=True, workers=2) == serial
    assert verify_feature_folder(folder, workers=3) == verify_feature_folder(folder)


def _boom(job: int) -> int:
    if job == 3:
        raise ValueError("job 3")
    return job * job


def test_ordered_map_yields_in_job_order_and_raises_a_workers_error():
    finished: list[int] = []
    assert list(ordered_map(_boom, [5, 1, 4, 2, 0], 3, finished.append)) == [25, 1, 16, 4, 0]
    assert sorted(finished) == [0, 1, 4, 16, 25]
    with pytest.raises(ValueError, match="job 3"):
        list(ordered_map(_boom, [1, 2, 3, 4], 2))
