"""Several streams in threads of one process (the thread run mode): each keeps its own cache plan, prefetched leases
and read-ahead table, so one stream's new plan, end or clear never wipes, releases or closes another's."""

from __future__ import annotations

import gc
import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shards.cache.cached_shards import CachedShards, PlannedShard
from shards.cache.node import ShardCache
from shards.cache.plan_view import live_plans
from shards.transport.parallel_parts import READ_AHEAD, drop_read_ahead, open_range, read_ahead

SHARD_BYTES = 1000


class StreamThread:
    """One thread that runs every call handed to it, so two of them interleave streams step by step."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1)

    def __call__(self, fn, *args):
        return self._pool.submit(fn, *args).result()

    def end(self) -> None:
        self._pool.shutdown()


@pytest.fixture
def threads():
    a, b = StreamThread(), StreamThread()
    yield a, b
    a.end()
    b.end()


def write_shards(folder: Path, tags: str) -> list[PlannedShard]:
    folder.mkdir()
    planned = []
    for tag in tags:
        data = (tag.encode() * SHARD_BYTES)[:SHARD_BYTES]
        path = folder / f"{tag}.tar"
        path.write_bytes(data)
        planned.append(PlannedShard(str(path), hashlib.sha256(data).hexdigest(), SHARD_BYTES))
    return planned


def settle(cache: CachedShards) -> None:
    """Wait until the prefetches submitted so far are done (the prefetch thread runs them in turn)."""
    cache._here()[1].submit(lambda: None).result()


def plans_by_first_read(cache: CachedShards) -> dict[str, tuple[tuple[str, ...], int]]:
    return {plan.reads[0]: (plan.reads, plan.position) for plan in live_plans(cache._here()[0].root)}


def test_streams_in_two_threads_keep_their_own_plans_and_prefetches(tmp_path, threads):
    one, two = threads
    a, b, c, x, y = write_shards(tmp_path / "data", "abcxy")
    cache = CachedShards(ShardCache(tmp_path / "cache", limit=100 * SHARD_BYTES, local=True))
    keys = lambda *shards: tuple(s.sha256 for s in shards)  # noqa: E731

    one(cache.plan, [a, b, c], [])
    one(cache.reached, 0)  # prefetches b and c
    two(cache.plan, [x, y], [])  # must not release one's prefetches nor replace its plan
    two(cache.reached, 0)  # prefetches y
    settle(cache)
    assert plans_by_first_read(cache) == {a.sha256: (keys(a, b, c), 0), x.sha256: (keys(x, y), 0)}

    one(cache.reached, 1)  # one's own plan advances, not two's
    assert plans_by_first_read(cache) == {a.sha256: (keys(a, b, c), 1), x.sha256: (keys(x, y), 0)}

    before = cache.stats.snapshot()
    assert before["misses"] == 3  # b, c and y, each fetched once by the prefetch thread
    lease_b = one(cache.lease, b.location, b.sha256, b.size)  # one's prefetch, handed over as it is
    assert lease_b is not None and lease_b.path.read_bytes() == Path(b.location).read_bytes()
    looked_up = one(cache.lease, y.location, y.sha256, y.size)  # not one's prefetch: looked up, a hit
    assert looked_up is not None and cache.stats.snapshot()["hits"] == before["hits"] + 1
    looked_up.release()

    one(cache.end_stream)  # releases one's prefetch of c; two's of y stays pending
    after = cache.stats.snapshot()
    lease_y = two(cache.lease, y.location, y.sha256, y.size)
    assert lease_y is not None and cache.stats.snapshot() == after  # taken from two's prefetch: no lookup
    assert plans_by_first_read(cache)[x.sha256] == (keys(x, y), 0)
    two(cache.end_stream)
    lease_b.release()
    lease_y.release()


def test_a_new_plan_in_one_thread_leaves_the_other_threads_prefetch(tmp_path, threads):
    one, two = threads
    a, b, x, y = write_shards(tmp_path / "data", "abxy")
    cache = CachedShards(ShardCache(tmp_path / "cache", limit=100 * SHARD_BYTES, local=True))
    one(cache.plan, [a, b], [])
    one(cache.reached, 0)
    two(cache.plan, [x, y], [])
    two(cache.reached, 0)
    two(cache.drop_prefetched)
    two(cache.plan, [y, x], [])  # a new plan: drops two's own prefetches only
    settle(cache)
    settled = cache.stats.snapshot()
    lease = one(cache.lease, b.location, b.sha256, b.size)
    assert lease is not None and cache.stats.snapshot() == settled
    lease.release()
    one(cache.end_stream)
    two(cache.end_stream)


@pytest.mark.slow  # over half a second in the quick loop
def test_a_thread_that_ended_takes_its_plan_file_with_it(tmp_path):
    a, b, x, y = write_shards(tmp_path / "data", "abxy")
    cache = CachedShards(ShardCache(tmp_path / "cache", limit=100 * SHARD_BYTES, local=True))
    cache.plan([x, y], [])  # this thread's stream
    ended = StreamThread()
    ended(cache.plan, [a, b], [])
    ended(cache.end_stream)
    assert len(live_plans(cache._here()[0].root)) == 2
    ended.end()
    gc.collect()
    assert [plan.reads[0] for plan in live_plans(cache._here()[0].root)] == [x.sha256]
    cache.end_stream()


class Opened:
    """A stand-in for a stream opened ahead: records whether it was closed."""

    def __init__(self, key) -> None:
        self.key, self.closed = key, False

    def close(self) -> None:
        self.closed = True


def test_read_ahead_tables_are_per_thread(threads):
    one, two = threads
    opened: dict[tuple, Opened] = {}

    def offer(url: str, start: int, stop: int) -> bool:
        return READ_AHEAD.offer((url, start, stop), 10_000,
                                lambda: opened.setdefault((url, start, stop), Opened((url, start, stop))))

    assert one(offer, "s3://b/one", 0, 100) and one(offer, "s3://b/one", 100, 200)
    assert two(offer, "s3://b/two", 0, 100) and two(offer, "s3://b/two", 100, 200)
    assert one(READ_AHEAD.held_bytes) == two(READ_AHEAD.held_bytes) == 200
    assert two(READ_AHEAD.take, ("s3://b/one", 0, 100)) is None  # one's entry: not two's to take
    taken = two(READ_AHEAD.take, ("s3://b/two", 100, 200))  # passes over (closes) two's first range only
    assert taken is opened["s3://b/two", 100, 200]
    assert opened["s3://b/two", 0, 100].closed
    two(drop_read_ahead)
    assert one(READ_AHEAD.held_bytes) == 200
    assert not any(opened["s3://b/one", start, stop].closed for start, stop in ((0, 100), (100, 200)))
    assert one(READ_AHEAD.take, ("s3://b/one", 0, 100)) is opened["s3://b/one", 0, 100]
    one(drop_read_ahead)
    assert opened["s3://b/one", 100, 200].closed and one(READ_AHEAD.held_bytes) == 0


def test_open_range_takes_the_calling_threads_read_ahead(threads):
    one, two = threads
    fetched: list[tuple[int, int]] = []

    def fetch(start: int, stop: int) -> bytes:
        fetched.append((start, stop))
        return bytes(stop - start)

    assert one(read_ahead, fetch, "s3://b/o", 0, 100, 2, 10_000)
    assert two(read_ahead, fetch, "s3://b/o", 100, 200, 2, 10_000)
    two(drop_read_ahead)  # two's new plan closes two's range, not one's
    stream = one(open_range, fetch, "s3://b/o", 0, 100, 2)
    assert one(stream.read) == bytes(100)
    assert fetched.count((0, 100)) == 1  # read ahead once, taken, never fetched again
    stream.close()
