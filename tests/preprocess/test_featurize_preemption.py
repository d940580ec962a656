"""precompute-features stopped by a signal keeps the shards it finished, says what a rerun does, exits 75, and the
rerun's files are those of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

import preprocess.features.cli as features_cli
import preprocess.features.featurize as featurize
from preprocess.features.featurize import FeatureConfig, run_precompute
from shards.cli.common import EXIT_PREEMPTED
from shards.jobs.preemption import Preempted
from tests.helpers import make_shard_dataset
from tests.stop_requests import StopAfter

SHARDS = {"train": [5, 3, 4], "val": [4]}
SMALL = dict(backbone="resnet18", weights="none", resize=40, crop=32, batch_size=4, workers=0, quiet=True)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.pt"))}


@pytest.mark.slow
def test_a_stopped_run_keeps_its_finished_shards_and_the_rerun_completes_them_exactly(tmp_path):
    data_dir = tmp_path / "data"
    make_shard_dataset(data_dir, shard_sizes=SHARDS, storage="tar")
    run_precompute(FeatureConfig(data_dir=data_dir, out_dir=tmp_path / "whole", **SMALL))
    out = tmp_path / "stopped"
    # Batches of 4 over shards of 5, 3, 4, 4: after batch 2 the first two shards are whole, the third is not begun.
    with pytest.raises(Preempted) as stopped:
        run_precompute(FeatureConfig(data_dir=data_dir, out_dir=out, **SMALL), StopAfter(2))
    assert stopped.value.line == (f"stopped by SIGTERM: 2 of this run's 4 shards written in {out}; the same command "
                                  f"again featurises the other 2 (the one in progress from its first image)")
    assert sorted(_files(out)) == ["train-000000.pt", "train-000001.pt"] and not (out / "features.json").exists()
    _, summary = run_precompute(FeatureConfig(data_dir=data_dir, out_dir=out, **SMALL))
    assert summary["complete"] and summary["shards_skipped"] == 2 and summary["shards_done"] == 2
    assert _files(out) == _files(tmp_path / "whole")


def test_the_command_prints_where_a_rerun_starts_and_exits_75(monkeypatch, tmp_path):
    def preempted(cfg, stop=None):
        raise Preempted("stopped by SIGUSR1: 1 of this run's 3 shards written in X; ...", "SIGUSR1")

    monkeypatch.setattr(featurize, "run_precompute", preempted)
    (tmp_path / "data").mkdir()
    result = CliRunner().invoke(features_cli.precompute_features_command,
                                [str(tmp_path / "data"), "--out", str(tmp_path / "feat"), "--backbone", "resnet18",
                                 "--weights", "none", "-q"])
    assert result.exit_code == EXIT_PREEMPTED == 75, result.output
    assert result.stderr.strip() == "stopped by SIGUSR1: 1 of this run's 3 shards written in X; ..."
