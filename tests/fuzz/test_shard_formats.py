"""Fuzzing the shard formats: tar headers (PAX and GNU records too), the tar byte index, HDF5 image shards,
``.npy`` column files and the source index, feature shards (``.pt`` and ``.h5``)."""

import pytest

from tests.fuzz.engine import fuzz

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]


@pytest.mark.parametrize("target", ["tar_shard", "tar_index", "hdf5_shard"])
def test_image_shards_read_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)


@pytest.mark.parametrize("target", ["npy_column", "source_index"])
def test_indexes_read_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)


@pytest.mark.parametrize("target", ["feature_pt", "feature_h5"])
def test_feature_shards_read_or_raise_a_shardcache_error(target, seeds):
    fuzz(target, seeds)
