"""The feature-cache section shows the per-dimension statistics precompute-features kept: dead dimensions counted,
the per-dimension std drawn, the warnings repeated; a cache without them says so."""

from __future__ import annotations

import json

import torch

from preprocess.features.feature_stats import FeatureStats, summarize
from shards.feature_stats import STATS_KEY
from shards.manifest import FEATURES_FILE
from shards.report.build import build_report
from tests.report.page import parse, tiles


def _with_stats(feature_dir, rows: torch.Tensor) -> None:
    stats = FeatureStats(rows.shape[1])
    stats.update(rows, rows.half())
    path = feature_dir / FEATURES_FILE
    manifest = json.loads(path.read_text())
    manifest[STATS_KEY] = summarize(stats, "float16", 2, 2).to_json()
    path.write_text(json.dumps(manifest))


def test_dead_dimensions_and_the_std_histogram_are_shown(feature_dir):
    rows = torch.cat([torch.randn(30, 10), torch.zeros(30, 6)], dim=1)  # 6 of 16 dims dead
    _with_stats(feature_dir, rows)
    html = build_report([feature_dir], grid=False)
    assert tiles(html)["dead dims (constant)"] == "6 / 16" and tiles(html)["all-zero dims"] == "6"
    text = parse(html).text
    assert "precompute-features warned: 6 of 16 feature dimensions are constant" in text
    assert 'aria-label="per-dimension std"' in html  # the histogram, drawn from the listed per-dim std


def test_a_cache_without_statistics_says_so(feature_dir):
    assert "Not recorded: this cache was written before" in parse(build_report([feature_dir], grid=False)).text


def test_an_unreadable_summary_is_said_not_fatal(feature_dir):
    path = feature_dir / FEATURES_FILE
    manifest = json.loads(path.read_text())
    manifest[STATS_KEY] = {"version": 99}
    path.write_text(json.dumps(manifest))
    assert "Unreadable" in parse(build_report([feature_dir], grid=False)).text
