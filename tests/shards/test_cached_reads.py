"""Streaming through the node-local shard cache: the same samples as the source, each shard fetched once per node,
a damaged copy fetched again, a tight limit with 2 workers, the limit error, and which locations are cached."""

from __future__ import annotations

from pathlib import Path

import pytest

import shards
from shards.errors import InputError
from shards.cache.cached_shards import CachedShards, on_network_fs
from shards.cache.node import ShardCache
from shards.loader.loader import workers_mode
from tests.helpers import make_shard_dataset

SIZES = {"train": [40, 25, 33, 18], "val": [10]}


@pytest.fixture
def data(tmp_path: Path) -> Path:
    make_shard_dataset(tmp_path / "data", shard_sizes=SIZES, size=(24, 20))
    return tmp_path / "data"


def keys_of(dataset, epoch: int, workers: int = 2) -> list[str]:
    loader = shards.make_loader(dataset, batch_size=8, mode=workers_mode(workers, persistent=False), drop_last=False)
    loader.set_epoch(epoch)
    return [k for _, _, batch_keys in loader for k in batch_keys]


def open_cached(data: Path, cache: Path, limit: int | None = None, **options):
    return shards.open_dataset(data, "train", transform=lambda image: 0, return_keys=True, seed=3, **options,
                               remote=shards.Remote(shard_cache=shards.ShardCache(dir=cache, limit=limit, local=True)))


def shard_bytes(data: Path) -> int:
    return sum(p.stat().st_size for p in data.glob("train-*.tar"))


@pytest.mark.slow
def test_cached_epochs_yield_the_source_samples_and_fetch_each_shard_once(data: Path, tmp_path: Path):
    plain = shards.open_dataset(data, "train", transform=lambda image: 0, return_keys=True, seed=3)
    cached = open_cached(data, tmp_path / "cache")
    for epoch in (0, 1):
        assert keys_of(cached, epoch) == keys_of(plain, epoch)
    counts = cached.shard_cache.stats.snapshot()
    assert counts["misses"] == 4 and counts["fetched_bytes"] == shard_bytes(data)
    assert counts["hits"] >= 4  # the whole second epoch came from the cache
    assert counts["refetches"] == counts["bypasses"] == 0
    assert len(list((tmp_path / "cache").rglob("*.tar"))) == 4


@pytest.mark.slow  # over half a second in the quick loop
def test_a_damaged_cached_copy_is_fetched_again_never_read(data: Path, tmp_path: Path):
    first = open_cached(data, tmp_path / "cache")
    expected = keys_of(first, 0)
    victim = sorted((tmp_path / "cache").rglob("*.tar"))[0]
    raw = bytearray(victim.read_bytes())
    raw[700] ^= 0xFF
    victim.write_bytes(bytes(raw))  # a new mtime: the stamp no longer matches
    again = open_cached(data, tmp_path / "cache")
    assert keys_of(again, 0) == expected
    counts = again.shard_cache.stats.snapshot()
    assert counts["refetches"] == 1 and counts["misses"] == 1


@pytest.mark.slow
def test_a_tight_limit_with_two_workers_evicts_or_bypasses_and_loses_nothing(data: Path, tmp_path: Path):
    largest = max(p.stat().st_size for p in data.glob("train-*.tar"))
    plain = shards.open_dataset(data, "train", transform=lambda image: 0, return_keys=True, seed=3)
    tight = open_cached(data, tmp_path / "cache", limit=largest + largest // 2)
    for epoch in (0, 1):
        assert keys_of(tight, epoch) == keys_of(plain, epoch)
    counts = tight.shard_cache.stats.snapshot()
    assert counts["evictions"] + counts["bypasses"] > 0
    on_disk = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*.tar"))
    assert on_disk <= largest + largest // 2


def test_a_limit_below_the_largest_shard_is_refused_at_open(data: Path, tmp_path: Path):
    with pytest.raises(InputError, match="cache"):
        open_cached(data, tmp_path / "cache", limit=1000)


def test_cache_limit_without_a_folder_is_refused(data: Path, monkeypatch):
    monkeypatch.delenv("SHARDCACHE_CACHE_DIR", raising=False)
    with pytest.raises(InputError, match="ShardCache.dir"):
        shards.open_dataset(data, "train", remote=shards.Remote(shard_cache=shards.ShardCache(limit="1G")))


def test_the_library_reads_no_environment(data: Path, tmp_path: Path, monkeypatch):
    """Only the CLIs turn $SHARDCACHE_CACHE_DIR into a cache folder; open_dataset takes what it is given."""
    monkeypatch.setenv("SHARDCACHE_CACHE_DIR", str(tmp_path / "env-cache"))
    assert shards.open_dataset(data, "train").shard_cache is None
    given = shards.open_dataset(data, "train", remote=shards.Remote(shard_cache=shards.ShardCache(tmp_path / "c")))
    assert given.shard_cache is not None and str(given.shard_cache.request.dir) == str(tmp_path / "c")
    assert not (tmp_path / "env-cache").exists()


def test_which_locations_go_through_the_cache(tmp_path: Path):
    auto = CachedShards(ShardCache(tmp_path / "c"))
    assert auto.cached("s3://bucket/data/train-000000.tar")
    assert auto.cached("https://host/data/train-000000.tar")
    assert not auto.cached("pipe:cat train-000000.tar")
    assert not on_network_fs(tmp_path) and not auto.cached(str(tmp_path / "train-000000.tar"))
    assert CachedShards(ShardCache(tmp_path / "c", local=True)).cached(str(tmp_path / "x.tar"))
    assert ShardCache(tmp_path, "2G").limit == 2 << 30
