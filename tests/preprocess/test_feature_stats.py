"""precompute-features checks what it writes: NaN/inf refused per shard, all-zero or constant features refused at the
end, float16 underflow and dead dimensions warned about, and the per-dimension statistics kept in features.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from preprocess.features import featurize
from preprocess.features.backbones import build_backbone
from preprocess.features.feature_stats import FeatureStats, check_features, check_shard, judge, summarize
from preprocess.features.featurize import FeatureConfig, run_precompute
from shards.errors import InputError
from shards.feature_stats import STATS_KEY, FeatureStatsSummary, read_summary, std_histogram
from shards.manifest import FEATURES_FILE, load_feature_manifest
from shards.report.build import build_report
from tests.helpers import make_shard_dataset

SMALL = dict(weights="none", resize=40, crop=32, batch_size=4, workers=0, quiet=True)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stats")
    make_shard_dataset(root, shard_sizes={"train": [5, 3], "val": [4]}, storage="tar")
    return root


def _stats(rows: torch.Tensor, dtype: torch.dtype = torch.float16) -> FeatureStats:
    stats = FeatureStats(rows.shape[1])
    stats.update(rows, rows.to(dtype))
    return stats


def test_running_statistics_equal_one_pass_and_survive_the_shard_record():
    rows = torch.randn(50, 6) * torch.arange(1, 7) + 3
    merged = FeatureStats(6)
    for part in rows.split(7):  # batches of one shard, and shards merged from their records
        merged.merge(FeatureStats.from_record(_stats(part, torch.float32).to_record(), 6))
    assert merged.samples == 50
    torch.testing.assert_close(merged.mean, rows.double().mean(0))
    torch.testing.assert_close((merged.m2 / 50).sqrt(), rows.double().std(0, unbiased=False))
    torch.testing.assert_close(merged.min, rows.amin(0))
    assert FeatureStats.from_record({"version": 1, "dims": 5}, 6) is None  # another shape: not counted


def test_float16_underflow_is_counted_and_judged():
    tiny = torch.rand(40, 8) * 1e-9 + 1e-10  # a random-init mobilenet's scale: float16 stores 0
    summary = summarize(_stats(tiny), "float16", 1, 1)
    assert summary.underflow_share == 1.0 and summary.zero_dims == 8
    errors, _ = judge(summary)
    assert "every stored feature value is zero" in errors[0] and "--dtype float32" in errors[0] \
        and "--weights FILE" in errors[0]
    errors, warnings = judge(summarize(_stats(tiny, torch.float32), "float32", 1, 1))  # float32 keeps them
    assert errors == [] and "--standardize" in warnings[0] and "--weights FILE" in warnings[0]
    small = torch.cat([torch.randn(40, 6), tiny[:, :2] * 100], dim=1)  # two dims of 1e-7: subnormal in float16
    errors, warnings = judge(summarize(_stats(small), "float16", 1, 1))
    assert errors == [] and "underflowed" in warnings[0] and "--dtype float32" in warnings[0]


def test_constant_and_nonfinite_features_are_errors_dead_dimensions_a_warning():
    assert "constant" in judge(summarize(_stats(torch.ones(10, 4)), "float16", 1, 1))[0][0]
    dead = torch.cat([torch.randn(10, 2), torch.zeros(10, 2)], dim=1)
    errors, warnings = judge(summarize(_stats(dead), "float16", 1, 1))
    assert errors == [] and "2 of 4 feature dimensions are constant" in warnings[0]
    with pytest.raises(InputError, match="NaN/inf"):
        check_features([_stats(torch.tensor([[1.0, float("nan")], [2.0, 3.0]])).to_record()], dims=2,
                       dtype="float16", where="out")
    with pytest.raises(InputError, match="exceed float16's range"):
        check_shard(_stats(torch.tensor([[1e6, 1.0], [2.0, 3.0]])), "out/x.pt")


def test_the_summary_round_trips_and_a_bad_one_is_refused():
    summary = summarize(_stats(torch.randn(20, 3)), "float16", 2, 3)
    assert FeatureStatsSummary.from_json(json.loads(json.dumps(summary.to_json()))) == summary
    bad = {**summary.to_json(), "std": [1.0]}
    with pytest.raises(InputError, match="1 values for 3 dimensions"):
        read_summary({STATS_KEY: bad}, "features.json")
    assert std_histogram([0.0, 0.0, 0.05, 0.5, 2.0]) == [("0 (dead)", 2), ("1e-2", 1), ("1e-1", 1), ("1e0", 1)]


@pytest.mark.slow
def test_a_healthy_backbone_writes_its_statistics_without_a_warning(dataset: Path, tmp_path: Path, caplog):
    with caplog.at_level(logging.WARNING):
        manifest, _ = run_precompute(FeatureConfig(data_dir=dataset, out_dir=tmp_path / "f", backbone="resnet18",
                                                   **SMALL))
    assert not [r for r in caplog.records if "preprocess.features" in r.name]
    summary = read_summary(load_feature_manifest(tmp_path / "f").extra)
    assert summary.samples == 12 and summary.shards == summary.shards_total == 3 and len(summary.std) == 512
    assert summary.warnings == () and summary.nonfinite == 0
    html = build_report([tmp_path / "f"], grid=False)
    assert "Feature statistics" in html and 'aria-label="per-dimension std"' in html


@pytest.mark.slow
def test_a_random_init_mobilenet_in_float16_is_refused_in_one_line(dataset: Path, tmp_path: Path):
    out = tmp_path / "f"
    with pytest.raises(InputError, match="every stored feature value is zero .*--dtype float32.*--weights FILE"):
        run_precompute(FeatureConfig(data_dir=dataset, out_dir=out, backbone="mobilenet_v3_small", **SMALL))
    assert not (out / FEATURES_FILE).exists()  # nothing a training run could pick up


class NaNHead(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((len(x), 4), float("nan"))


def test_a_backbone_putting_out_nan_is_refused_before_its_shard_is_written(dataset: Path, tmp_path: Path,
                                                                           monkeypatch):
    real = build_backbone

    def nan_backbone(name, weights="none", *, seed=0):
        backbone = real("resnet18", weights, seed=seed)
        return type(backbone)(**{**backbone.__dict__, "model": NaNHead(), "features_dim": 4})

    monkeypatch.setattr(featurize, "build_backbone", nan_backbone)
    out = tmp_path / "f"
    with pytest.raises(InputError, match="NaN/inf feature values: refused"):
        run_precompute(FeatureConfig(data_dir=dataset, out_dir=out, backbone="resnet18", **SMALL))
    assert not list(out.glob("*.pt")) and not (out / FEATURES_FILE).exists()
