"""Object storage through the node-local cache: two epochs fetch each shard once, and the samples are those of the
source in the same order."""

from __future__ import annotations

from pathlib import Path

import pytest

import shards
from shards.transport import s3
from shards.loader.worker_processes import WorkerProcesses
from tests.s3.test_read import packed

pytestmark = [pytest.mark.s3, pytest.mark.slow]  # slow: starting and stopping SeaweedFS takes seconds


def keys(dataset, epoch: int) -> list[str]:
    loader = shards.make_loader(dataset, batch_size=4, mode=WorkerProcesses(2, persistent=False), drop_last=False)
    loader.set_epoch(epoch)
    return [k for _, _, batch in loader for k in batch]


@pytest.mark.parametrize("storage", ["tar", "hdf5"])
def test_two_epochs_from_s3_fetch_each_shard_once(bucket, tmp_path: Path, storage: str):
    folder = packed(tmp_path / "data", storage)
    url = bucket.upload(folder, "data")
    local = shards.open_dataset(folder, transform=lambda image: 0, return_keys=True, seed=1)
    cached = shards.open_dataset(url, transform=lambda image: 0, return_keys=True, seed=1,
                                 remote=shards.Remote(shard_cache=shards.ShardCache(dir=tmp_path / "node-cache")))
    s3.share_stats()
    s3.FETCH_STATS.reset()  # after the manifest: count the shard bytes
    for epoch in (0, 1):
        assert keys(cached, epoch) == keys(local, epoch)
    shard_bytes = sum(s.bytes for s in cached.split_info.shards)
    index_bytes = sum((folder / (s.path + ".idx")).stat().st_size for s in cached.split_info.shards
                      if (folder / (s.path + ".idx")).exists())
    # whole shards once, plus each worker's copy of the indexes (read when a slice starts mid-shard)
    assert shard_bytes <= s3.FETCH_STATS.bytes <= shard_bytes + 2 * index_bytes
    counts = cached.shard_cache.stats.snapshot()
    assert counts["misses"] == len(cached.split_info.shards) and counts["fetched_bytes"] == shard_bytes
