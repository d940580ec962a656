"""Fuzzing adopted WebDataset tars: the row index, ``shards index``'s scan of a tar, and the reader over a tar
mutated under a fixed index (every sample served is one the index recorded, or a typed error)."""

import pytest

from tests.fuzz.engine import fuzz

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]


@pytest.mark.parametrize("target", ["adopt_rows", "adopt_reader", "adopt_scan"])
def test_adopted_tars_read_the_indexed_samples_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)
