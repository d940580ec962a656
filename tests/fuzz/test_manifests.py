"""Fuzzing the manifests and run records: ``dataset.json`` and ``features.json`` through every reader of a folder
(load, summary, stream, verify, report), and a run folder's ``config.json``, ``metrics.jsonl`` and
``data-events.jsonl`` through ``shards report`` and lineage."""

import pytest

from tests.fuzz.engine import fuzz

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]


@pytest.mark.parametrize("target", ["dataset_json", "features_json"])
def test_manifests_read_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)


@pytest.mark.parametrize("target", ["run_record", "run_metrics", "run_events"])
def test_run_folders_read_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)
