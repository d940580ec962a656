"""The node-local shard cache: one download per node, verified copies, eviction that spares live readers, and a
bypass (never a deadlock) when there is no room."""

from __future__ import annotations

import errno
import hashlib
import logging
import multiprocessing
import os
import pickle
import time
from pathlib import Path

import pytest

from shards.atomic import host_tag
from shards.cache.node import CacheFullError, ShardCache, NodeCache
from shards.cache.node_index import CacheStats
from shards.errors import ChecksumError, InputError

FORK = multiprocessing.get_context("fork")
SHARD_BYTES = 1000


def shard(tag: str, size: int = SHARD_BYTES) -> tuple[bytes, str]:
    data = (tag.encode() * size)[:size]
    return data, hashlib.sha256(data).hexdigest()


def writer_of(data: bytes, calls: list[str] | None = None):
    def fetch(fileobj) -> None:
        if calls is not None:
            calls.append("fetch")
        fileobj.write(data[: len(data) // 2])
        fileobj.write(data[len(data) // 2:])
    return fetch


def shard_files(cache_dir: Path) -> list[Path]:
    """Finished copies and temp files: what occupies the cache's disk."""
    return [p for p in (cache_dir / "v1").glob("??/*") if not p.name.endswith(".ok")]


def disk_bytes(cache_dir: Path) -> int:
    return sum(p.stat().st_size for p in shard_files(cache_dir))


def read_lease(cache: NodeCache, data: bytes, sha: str, calls: list[str] | None = None) -> bytes:
    with cache.acquire(sha, len(data), ".tar", writer_of(data, calls), f"s3://bucket/{sha[:8]}.tar") as lease:
        return lease.path.read_bytes()


# -- one download per node ----------------------------------------------------------------------------------------
def _race_child(settings, stats, barrier, counter: Path, results: Path, index: int) -> None:
    data, sha = shard("race", 200_000)

    def slow_fetch(fileobj) -> None:
        with open(counter, "a") as handle:
            handle.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # long enough that every other process arrives while this one downloads
        fileobj.write(data)

    cache = NodeCache(settings, stats)
    barrier.wait()
    with cache.acquire(sha, len(data), ".tar", slow_fetch, "s3://bucket/race.tar") as lease:
        (results / f"{index}.sha").write_text(hashlib.sha256(lease.path.read_bytes()).hexdigest())


@pytest.mark.slow  # over half a second in the quick loop
def test_processes_racing_for_one_shard_fetch_it_once(tmp_path):
    settings, stats = ShardCache(str(tmp_path / "cache")), CacheStats()
    counter, results = tmp_path / "fetches.txt", tmp_path / "results"
    results.mkdir()
    barrier = FORK.Barrier(6)
    children = [FORK.Process(target=_race_child, args=(settings, stats, barrier, counter, results, i))
                for i in range(6)]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0] * 6
    data, sha = shard("race", 200_000)
    assert len(counter.read_text().splitlines()) == 1
    assert {p.read_text() for p in results.iterdir()} == {sha}
    assert len(list(results.iterdir())) == 6
    counts = stats.snapshot()
    assert (counts["misses"], counts["hits"], counts["refetches"], counts["bypasses"]) == (1, 5, 0, 0)
    assert counts["fetched_bytes"] == len(data) and counts["served_bytes"] == 6 * len(data)
    assert counts["hit_rate"] == pytest.approx(5 / 6)


def test_a_second_lookup_is_a_hit_and_the_copy_is_keyed_by_sha256(tmp_path):
    cache = NodeCache(ShardCache(tmp_path))
    data, sha = shard("a")
    calls: list[str] = []
    assert read_lease(cache, data, sha, calls) == data
    assert read_lease(NodeCache(ShardCache(tmp_path), cache.stats), data, sha, calls) == data
    assert calls == ["fetch"]
    assert (tmp_path / "v1" / sha[:2] / f"{sha}.tar").read_bytes() == data
    counts = cache.stats.snapshot()
    assert (counts["hits"], counts["misses"], counts["served_bytes"]) == (1, 1, 2 * len(data))


# -- verified copies -----------------------------------------------------------------------------------------------
def test_a_rewritten_copy_is_fetched_again(tmp_path):
    cache = NodeCache(ShardCache(tmp_path))
    data, sha = shard("a")
    calls: list[str] = []
    read_lease(cache, data, sha, calls)
    cached = cache.entry_path(sha, ".tar")
    with open(cached, "r+b") as handle:
        handle.write(b"X")
    # A rewrite moves mtime; set it explicitly so a coarse file system clock cannot hide the change.
    info = cached.stat()
    os.utime(cached, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))

    fresh = NodeCache(ShardCache(tmp_path), cache.stats)
    assert read_lease(fresh, data, sha, calls) == data
    assert calls == ["fetch", "fetch"]
    assert cache.stats.snapshot()["refetches"] == 1


def test_a_partial_copy_without_a_stamp_is_never_read(tmp_path):
    cache = NodeCache(ShardCache(tmp_path))
    data, sha = shard("a")
    cached = cache.entry_path(sha, ".tar")
    cached.parent.mkdir(parents=True)
    cached.write_bytes(data[:100])  # a copy by some other tool, or one whose stamp was never written
    calls: list[str] = []
    assert read_lease(cache, data, sha, calls) == data
    assert calls == ["fetch"]
    assert cache.stats.snapshot()["refetches"] == 1


def test_verify_all_finds_the_corruption_the_stamp_check_cannot_see(tmp_path):
    cache = NodeCache(ShardCache(tmp_path))
    data, sha = shard("a")
    other, other_sha = shard("b")
    read_lease(cache, data, sha)
    read_lease(cache, other, other_sha)
    cached = cache.entry_path(sha, ".tar")
    info = cached.stat()
    with open(cached, "r+b") as handle:  # bit rot: same size, same inode, and the mtime put back
        handle.write(b"X")
    os.utime(cached, ns=(info.st_atime_ns, info.st_mtime_ns))

    assert cache.verify_all() == {"checked": 2, "removed": 1, "skipped": 0}
    assert not cached.exists() and cache.entry_path(other_sha, ".tar").exists()
    calls: list[str] = []
    assert read_lease(cache, data, sha, calls) == data
    assert calls == ["fetch"]


def test_wrong_bytes_from_the_source_raise_a_checksum_error_and_leave_nothing(tmp_path):
    cache = NodeCache(ShardCache(tmp_path, limit=10 * SHARD_BYTES))
    data, sha = shard("a")
    wrong, _ = shard("b")
    with pytest.raises(ChecksumError, match="s3://bucket/a.tar"):
        cache.acquire(sha, len(data), ".tar", writer_of(wrong), "s3://bucket/a.tar")
    with pytest.raises(ChecksumError, match="more than the manifest's 1000 bytes"):
        cache.acquire(sha, len(data), ".tar", writer_of(data + b"extra"), "s3://bucket/a.tar")
    assert shard_files(tmp_path) == []
    assert list((tmp_path / "v1" / "reserve").iterdir()) == []
    assert read_lease(cache, data, sha) == data  # and nothing stops a correct fetch afterwards


# -- room -----------------------------------------------------------------------------------------------------------
def _hold_lease(settings, data: bytes, sha: str, held, done) -> None:
    lease = NodeCache(settings).acquire(sha, len(data), ".tar", writer_of(data), "s3://bucket/a.tar")
    held.set()
    done.wait(30)
    lease.release()


def test_eviction_spares_leased_shards_and_bypasses_when_everything_is_leased(tmp_path):
    settings = ShardCache(tmp_path, limit=int(2.5 * SHARD_BYTES))
    (a, sha_a), (b, sha_b), (c, sha_c) = shard("a"), shard("b"), shard("c")
    held, done = FORK.Event(), FORK.Event()
    reader = FORK.Process(target=_hold_lease, args=(settings, a, sha_a, held, done))
    reader.start()
    try:
        assert held.wait(30)
        cache = NodeCache(settings)
        assert read_lease(cache, b, sha_b) == b
        assert disk_bytes(tmp_path) <= settings.limit
        lease_c = cache.acquire(sha_c, len(c), ".tar", writer_of(c), "s3://bucket/c.tar")
        assert disk_bytes(tmp_path) <= settings.limit
        # A is the least recently used but another process reads it; B goes.
        assert cache.entry_path(sha_a, ".tar").exists() and cache.entry_path(sha_c, ".tar").exists()
        assert not cache.entry_path(sha_b, ".tar").exists()

        calls: list[str] = []
        assert cache.acquire(sha_b, len(b), ".tar", writer_of(b, calls), "s3://bucket/b.tar") is None
        assert calls == [] and disk_bytes(tmp_path) <= settings.limit
        assert list((tmp_path / "v1" / "reserve").iterdir()) == []
        counts = cache.stats.snapshot()
        assert (counts["evictions"], counts["bypasses"]) == (1, 1)

        lease_c.release()  # now C may go
        assert read_lease(cache, b, sha_b) == b
        assert not cache.entry_path(sha_c, ".tar").exists()
        assert disk_bytes(tmp_path) <= settings.limit
    finally:
        done.set()
        reader.join(30)
    assert reader.exitcode == 0


def test_eviction_removes_the_least_recently_used_and_a_hit_counts_as_a_use(tmp_path):
    cache = NodeCache(ShardCache(tmp_path, limit=int(3.5 * SHARD_BYTES)))
    shards = {tag: shard(tag) for tag in "abcd"}
    for tag in "abc":
        read_lease(cache, *shards[tag])
    now = time.time()
    for age, tag in ((30, "a"), (20, "b"), (10, "c")):  # distinct ages, whatever the clock's granularity
        stamp = Path(f"{cache.entry_path(shards[tag][1], '.tar')}.ok")
        os.utime(stamp, (now - age, now - age))
    read_lease(cache, *shards["a"])  # a hit: A becomes the most recently used
    read_lease(cache, *shards["d"])
    assert [cache.entry_path(shards[tag][1], ".tar").exists() for tag in "abcd"] == [True, False, True, True]
    assert cache.stats.snapshot()["evictions"] == 1


def _busy_reader(settings, stats, seed: int) -> None:
    cache = NodeCache(settings, stats)
    for step in range(12):
        data, sha = shard("abcdef"[(seed + step * (seed + 1)) % 6])
        lease = cache.acquire(sha, len(data), ".tar", writer_of(data), "s3://bucket/x.tar")
        if lease is not None:  # a bypass is allowed under this much pressure; a wrong byte or a hang is not
            with lease:
                assert lease.path.read_bytes() == data


def test_busy_readers_under_a_tight_limit_never_hang_or_read_wrong_bytes(tmp_path):
    settings, stats = ShardCache(tmp_path, limit=3 * SHARD_BYTES), CacheStats()
    readers = [FORK.Process(target=_busy_reader, args=(settings, stats, seed)) for seed in range(4)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(30)
    assert [reader.exitcode for reader in readers] == [0] * 4
    counts = stats.snapshot()
    assert counts["hits"] + counts["misses"] + counts["bypasses"] == 48
    assert disk_bytes(tmp_path) <= settings.limit
    assert list((tmp_path / "v1" / "reserve").iterdir()) == []


def test_a_limit_below_the_largest_shard_is_refused_up_front(tmp_path):
    cache = NodeCache(ShardCache(tmp_path / "cache", limit=1 << 30))
    with pytest.raises(InputError) as caught:
        cache.check_limit(2 << 30, "imagenet-train")
    message = str(caught.value)
    assert str(tmp_path / "cache") in message and "1.0 GiB" in message and "2.0 GiB" in message
    assert "imagenet-train" in message and "\n" not in message
    cache.check_limit(1 << 30, "imagenet-train")
    NodeCache(ShardCache(tmp_path / "unlimited")).check_limit(1 << 40, "imagenet-train")


def test_a_shard_larger_than_the_limit_is_read_from_the_source(tmp_path):
    cache = NodeCache(ShardCache(tmp_path, limit=SHARD_BYTES // 2))
    data, sha = shard("a")
    calls: list[str] = []
    assert cache.acquire(sha, len(data), ".tar", writer_of(data, calls), "s3://bucket/a.tar") is None
    assert calls == [] and cache.stats.snapshot()["bypasses"] == 1


# -- a full disk ------------------------------------------------------------------------------------------------------
def disk_full(fileobj) -> None:
    fileobj.write(b"some bytes")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_names_the_cache_and_the_way_out(tmp_path):
    cache = NodeCache(ShardCache(tmp_path / "cache", limit=10 * SHARD_BYTES))
    data, sha = shard("a")
    with pytest.raises(CacheFullError) as caught:
        cache.acquire(sha, len(data), ".tar", disk_full, "s3://bucket/a.tar")
    message = str(caught.value)
    assert str(tmp_path / "cache") in message and "no space left on device" in message
    assert "--cache-limit" in message and "--cache-fallback" in message and "ShardCache.fallback" in message
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    assert shard_files(tmp_path / "cache") == []
    assert list((tmp_path / "cache" / "v1" / "reserve").iterdir()) == []


def test_a_full_disk_with_fallback_reads_from_the_source_and_warns_once(tmp_path, caplog):
    cache = NodeCache(ShardCache(tmp_path, fallback=True))
    data, sha = shard("a")
    with caplog.at_level(logging.DEBUG, logger="shardcache.cache"):
        assert cache.acquire(sha, len(data), ".tar", disk_full, "s3://bucket/a.tar") is None
        assert cache.acquire(sha, len(data), ".tar", disk_full, "s3://bucket/a.tar") is None
    warnings = [r for r in caplog.records if r.name == "shardcache.cache" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(tmp_path) in warnings[0].getMessage()
    assert cache.stats.snapshot()["bypasses"] == 2
    assert shard_files(tmp_path) == []


# -- keys, leftovers, counters -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sha", "suffix"), [
    ("A" * 64, ".tar"), ("a" * 63, ".tar"), ("g" * 64, ".tar"), ("../" + "a" * 61, ".tar"),
    ("a" * 64, "tar"), ("a" * 64, ".TAR"), ("a" * 64, ".toolongsx"), ("a" * 64, "./x"), ("a" * 64, ""),
])
def test_invalid_keys_are_refused_before_anything_is_fetched(tmp_path, sha, suffix):
    calls: list[str] = []
    with pytest.raises(InputError):
        NodeCache(ShardCache(tmp_path)).acquire(sha, 10, suffix, writer_of(b"x" * 10, calls), "s3://b/x")
    assert calls == []


def test_leftovers_of_killed_processes_are_removed_when_the_cache_opens(tmp_path):
    _, sha = shard("a")
    NodeCache(ShardCache(tmp_path))
    folder = tmp_path / "v1" / sha[:2]
    folder.mkdir()
    dead = FORK.Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    dead_tmp = folder / f"{sha}.tar.{host_tag()}.{dead.pid}.0123abcd.tmp"
    live_tmp = folder / f"{sha}.tar.{host_tag()}.{os.getpid()}.89abcdef.tmp"
    old_tmp = folder / f"{sha}.tar.ok.otherhost.1234.deadbeef.tmp"
    for leftover in (dead_tmp, live_tmp, old_tmp):
        leftover.write_bytes(b"partial")
    os.utime(old_tmp, (time.time() - 7200, time.time() - 7200))
    reservation = tmp_path / "v1" / "reserve" / sha
    reservation.write_text('{"size": 1000}')

    cleaned = NodeCache(ShardCache(tmp_path, limit=SHARD_BYTES)).clean_stale()
    assert cleaned == {"temp_files": 0, "reservations": 0}  # the cache opening above already removed them
    assert not dead_tmp.exists() and not old_tmp.exists() and not reservation.exists()
    assert live_tmp.exists()  # a live writer's file (this process) stays


def test_stats_share_one_block_with_spawned_processes_and_copy_otherwise():
    spawn = multiprocessing.get_context("spawn")
    stats = CacheStats(spawn)
    assert stats.snapshot()["hit_rate"] is None
    stats.add(hits=3, misses=1)
    child = spawn.Process(target=stats.add, kwargs={"hits": 4})
    child.start()
    child.join(30)
    assert stats.snapshot()["hits"] == 7 and stats.snapshot()["hit_rate"] == 7 / 8
    copy = pickle.loads(pickle.dumps(stats))
    copy.add(hits=1)
    assert copy.snapshot()["hits"] == 8 and stats.snapshot()["hits"] == 7
    with pytest.raises(TypeError):
        stats.add(hitz=1)
    stats.reset()
    assert stats.snapshot() == {**{name: 0 for name in stats.snapshot() if name != "hit_rate"}, "hit_rate": None}
