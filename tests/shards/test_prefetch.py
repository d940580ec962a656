"""The node cache's prefetch of a worker's next shard: while one shard is read, the next one in the worker's plan is
fetched on the ``shardcache-prefetch`` thread, so its copy is in the cache before its first sample is read; a
stream that stops early lets go of what it prefetched.

Observed without timing: ``NodeCache.acquire`` and ``read_resync`` (what the stream reads) are wrapped to record
which thread fetched each shard and what the cache held when each shard's read began; every wait is bounded and on
an event.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

import pytest

import shards
from shards.cache.node import NodeCache
from tests.helpers import make_shard_dataset

SIZES = [4, 3, 5, 2]
WAIT_S = 10.0  # a bound on each wait, never reached unless the behaviour is broken


def raw(sample, seed):
    return sample.key, sample.data


def cached_dataset(tmp_path: Path, *, shuffle: bool):
    make_shard_dataset(tmp_path / "data", shard_sizes={"train": SIZES})
    return shards.open_dataset(tmp_path / "data", "train", seed=5, return_keys=True, decode=shards.Decode(decoder=raw),
                               sampling=shards.Sampling(shuffle=shuffle),
                               distributed=shards.Distributed(rank=0, world_size=1),
                               remote=shards.Remote(shard_cache=shards.ShardCache(dir=tmp_path / "cache", local=True,
                                                                                  prefetch_bytes=0)))  # next only


def shard_order(dataset) -> list[int]:
    """The shards of the main process's plan (worker 0 of 1, epoch 0) in the order they are read."""
    order: list[int] = []
    for piece in dataset.worker_plan(dataset.epoch, 0, 1):
        if not order or order[-1] != piece.shard:
            order.append(piece.shard)
    return order


def cached_copies(cache_dir: Path) -> set[str]:
    """The sha256 of every shard copy in the cache folder under its final name."""
    return {path.name.split(".")[0] for path in cache_dir.rglob("*.tar")}


class Observer:
    """Records, per shard: the thread that ran its ``acquire``, whether the shard before it in the plan had its
    first sample read when that fetch began, and what the cache folder held when the shard's read began."""

    def __init__(self, dataset, cache_dir: Path, monkeypatch):
        self.order = shard_order(dataset)
        self.by_location = {location: shard for shard, location in enumerate(dataset.locations)}
        self.sha256 = [info.sha256 for info in dataset.split_info.shards]
        self.cache_dir = cache_dir
        self.first_sample_read = {shard: threading.Event() for shard in self.order}
        self.acquired = {shard: threading.Event() for shard in self.order}
        self.acquire_thread: dict[int, str] = {}
        self.previous_was_being_read: dict[int, bool] = {}
        self.copy_ready_at_read: dict[int, bool] = {}
        self.misses_at_read: dict[int, int] = {}
        real_acquire, real_read = NodeCache.acquire, dataset.read_resync
        observer = self

        def acquire(cache, sha256, size, suffix, fetch, source, **options):
            shard = observer.by_location[source]
            thread = threading.current_thread()
            observer.acquire_thread.setdefault(shard, thread.name)
            place = observer.order.index(shard)
            if place > 0 and thread is not threading.main_thread():
                # Held until the previous shard's first sample is read: a fetch that then completes ran beside
                # that read. (Not on the reading thread, where the event could not be set while it waits.)
                previous = observer.order[place - 1]
                observer.previous_was_being_read[shard] = observer.first_sample_read[previous].wait(WAIT_S)
            try:
                return real_acquire(cache, sha256, size, suffix, fetch, source, **options)
            finally:
                observer.acquired[shard].set()

        def read_resync(piece):
            shard = piece.shard
            if shard != observer.order[0]:
                observer.copy_ready_at_read[shard] = (observer.acquired[shard].wait(WAIT_S)
                                                      and observer.sha256[shard] in cached_copies(cache_dir))
            observer.misses_at_read.setdefault(shard, dataset.shard_cache.stats.snapshot()["misses"])
            for number, sample in enumerate(real_read(piece)):
                if number == 0:
                    observer.first_sample_read[shard].set()
                yield sample

        monkeypatch.setattr(NodeCache, "acquire", acquire)
        monkeypatch.setattr(dataset, "read_resync", read_resync)


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_next_shard_is_in_the_cache_before_its_first_sample_is_read(tmp_path, monkeypatch, shuffle):
    dataset = cached_dataset(tmp_path, shuffle=shuffle)
    observer = Observer(dataset, tmp_path / "cache", monkeypatch)
    order = observer.order
    assert sorted(order) == list(range(len(SIZES)))
    if shuffle:
        assert order != sorted(order)  # the prefetch follows the plan, not the shard numbers

    keys = [key for (key, _), _, _ in dataset]

    assert len(keys) == sum(SIZES)
    assert observer.acquire_thread[order[0]] == threading.main_thread().name  # nothing to overlap the first with
    for shard in order[1:]:
        assert observer.acquire_thread[shard].startswith("shardcache-prefetch"), (shard, observer.acquire_thread)
        assert observer.previous_was_being_read[shard], shard
        assert observer.copy_ready_at_read[shard], shard
    # Each shard was fetched exactly once, before the read of the shard after it: misses counted ahead of reads.
    assert [observer.misses_at_read[shard] for shard in order] == [0, *range(2, len(order) + 1)]
    counts = dataset.shard_cache.summary()
    assert counts["misses"] == len(SIZES) and counts["hits"] == 0
    assert counts["fetched_bytes"] == sum(info.bytes for info in dataset.split_info.shards)
    for shard, info in enumerate(dataset.split_info.shards):
        copies = list((tmp_path / "cache").rglob(f"{info.sha256}.tar"))
        assert len(copies) == 1 and copies[0].read_bytes() == (tmp_path / "data" / info.path).read_bytes()


def test_a_second_pass_reads_every_shard_from_the_cache_without_fetching(tmp_path, monkeypatch):
    dataset = cached_dataset(tmp_path, shuffle=True)
    first = [key for (key, _), _, _ in dataset]
    observer = Observer(dataset, tmp_path / "cache", monkeypatch)
    fetched: list[str] = []  # locations whose fetch function ran (wrote bytes into the cache)
    real_fetcher = dataset.shard_cache._fetcher

    def fetcher(location):
        fetch = real_fetcher(location)

        def recorded(out):
            fetched.append(location)
            fetch(out)
        return recorded

    monkeypatch.setattr(dataset.shard_cache, "_fetcher", fetcher)
    assert [key for (key, _), _, _ in dataset] == first
    assert fetched == []
    counts = dataset.shard_cache.summary()
    assert counts["misses"] == len(SIZES) and counts["hits"] == len(SIZES)
    assert counts["fetched_bytes"] == sum(info.bytes for info in dataset.split_info.shards)
    assert all(observer.copy_ready_at_read[shard] for shard in observer.order[1:])
    assert all(observer.acquire_thread[shard].startswith("shardcache-prefetch") for shard in observer.order[1:])


def lease_held(cache_dir: Path, sha256: str) -> bool:
    """Whether some reader holds a lease on a shard's copy (its shared lock blocks an exclusive one)."""
    leases = list(cache_dir.rglob(f"{sha256}.lease"))
    assert len(leases) == 1, leases
    fd = os.open(leases[0], os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_stream_stopped_early_releases_the_shard_it_prefetched(tmp_path, monkeypatch):
    dataset = cached_dataset(tmp_path, shuffle=False)
    observer = Observer(dataset, tmp_path / "cache", monkeypatch)
    first, second = observer.order[:2]
    stream = iter(dataset)
    next(stream)
    assert observer.acquired[second].wait(WAIT_S)  # prefetched while the first shard is read
    assert lease_held(tmp_path / "cache", observer.sha256[second])
    stream.close()

    assert not lease_held(tmp_path / "cache", observer.sha256[first])
    assert not lease_held(tmp_path / "cache", observer.sha256[second])  # not pinned against eviction any more
    assert cached_copies(tmp_path / "cache") == {observer.sha256[first], observer.sha256[second]}
    counts = dataset.shard_cache.summary()
    assert counts["misses"] == 2 and counts["hits"] == 0

    monkeypatch.undo()
    assert len([key for (key, _), _, _ in dataset]) == sum(SIZES)
    counts = dataset.shard_cache.summary()
    assert counts["hits"] == 2 and counts["misses"] == len(SIZES)  # the prefetched copy is used, not fetched again
