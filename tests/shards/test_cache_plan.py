"""The node cache when the data is bigger than the disk: eviction by next use in the readers' shared plans, the
prefetch that never evicts what is needed sooner, and the plans' lifetime (docs/caching.md).

The victim rule is checked against an exhaustive search over eviction choices (equal sizes) and against its own
definition (unequal sizes); the rest runs real readers, real processes and a real cache folder."""

from __future__ import annotations

import functools
import hashlib
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest

import shards
from shards.cache.eviction import FURTHEST, LRU, UNNEEDED, Entry, choose_victims, eviction_order
from shards.cache.node import NodeCache, ShardCache
from shards.cache.node_index import ideal_fetch_bytes
from shards.cache.plan_view import PLANS, PlanPublisher, live_plans, next_uses
from shards.errors import InputError
from shards.select.mixture import SourceSpec, Subset
from shards.loader.worker_processes import WorkerProcesses
from shards.loader.loader import workers_mode
from tests.helpers import make_shard_dataset

FORK = multiprocessing.get_context("fork")
SHARDS = 8
PER_SHARD = 6
WAIT_S = 20.0


# -- the rule --------------------------------------------------------------------------------------------------
def upcoming_uses(sequence: list[int], t: int) -> dict[str, int]:
    uses: dict[str, int] = {}
    for distance, shard in enumerate(sequence[t:]):
        uses.setdefault(str(shard), distance)
    return uses


def misses_with_rule(sequence: list[int], capacity: int) -> int:
    cache: dict[str, float] = {}
    misses = 0
    for t, shard in enumerate(sequence):
        key = str(shard)
        if key not in cache:
            misses += 1
            if len(cache) == capacity:
                entries = [Entry(k, 1, last) for k, last in cache.items()]
                (victim, _), = choose_victims(entries, upcoming_uses(sequence, t), 1)
                del cache[victim.key]
        cache[key] = t
    return misses


def fewest_misses(sequence: list[int], capacity: int) -> int:
    """Exhaustive search over every eviction choice: the optimum a rule can reach (each read is cached)."""
    @functools.lru_cache(maxsize=None)
    def best(t: int, held: frozenset[int]) -> int:
        if t == len(sequence):
            return 0
        shard = sequence[t]
        if shard in held:
            return best(t + 1, held)
        if len(held) < capacity:
            return 1 + best(t + 1, held | {shard})
        return 1 + min(best(t + 1, (held - {victim}) | {shard}) for victim in held)
    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(40))
def test_eviction_by_next_use_misses_no_more_than_the_exhaustive_optimum(seed):
    rng = random.Random(seed)
    shard_count, capacity = rng.randint(3, 6), rng.randint(1, 3)
    # Epochs in a new random order each, as the plan reads them; or a free random sequence.
    if seed % 2:
        sequence = [s for _ in range(3) for s in rng.sample(range(shard_count), shard_count)]
    else:
        sequence = [rng.randrange(shard_count) for _ in range(14)]
    assert misses_with_rule(sequence, capacity) == fewest_misses(sequence, capacity)


@pytest.mark.parametrize("seed", range(60))
def test_unequal_sizes_evict_the_shortest_prefix_of_the_documented_order(seed):
    rng = random.Random(seed)
    entries = [Entry(f"{i:064x}", rng.randint(1, 9), rng.random()) for i in range(rng.randint(0, 8))]
    uses = {e.key: rng.randint(0, 20) for e in entries if rng.random() < 0.7}
    horizon = rng.choice([None, 0, 5, 12])
    needed = rng.randint(0, 30)
    victims = choose_victims(entries, uses, needed, horizon)

    unneeded = sorted((e for e in entries if e.key not in uses), key=lambda e: e.last_use)
    later = sorted((e for e in entries if e.key in uses and (horizon is None or uses[e.key] > horizon)),
                   key=lambda e: (-uses[e.key], e.last_use))
    order = [(e, UNNEEDED) for e in unneeded] + [(e, FURTHEST) for e in later]
    assert victims == order[:len(victims)]  # a prefix of the order
    freed = sum(e.size for e, _ in victims)
    if freed < needed:
        assert victims == order  # not enough: everything that may go
    elif victims:
        assert freed - victims[-1][0].size < needed  # the shortest prefix that covers the need
    assert all(e.key not in uses or horizon is None or uses[e.key] > horizon for e, _ in victims)


def test_without_plans_the_order_is_least_recently_used():
    entries = [Entry("b" * 64, 5, 2.0), Entry("a" * 64, 5, 1.0), Entry("c" * 64, 5, 3.0)]
    assert [(e.key[0], why) for e, why in eviction_order(entries, None)] == [("a", LRU), ("b", LRU), ("c", LRU)]
    assert [e.key[0] for e, _ in choose_victims(entries, None, 6)] == ["a", "b"]


def test_the_ideal_is_what_does_not_fit():
    assert ideal_fetch_bytes(1000, 400) == 600
    assert ideal_fetch_bytes(1000, 400, nodes=3) == 0
    assert ideal_fetch_bytes(1000, None) == 0


# -- plans and the node cache ------------------------------------------------------------------------------------
def blob(tag: str, size: int = 1000) -> tuple[bytes, str]:
    data = (tag.encode() * size)[:size]
    return data, hashlib.sha256(data).hexdigest()


def fill(cache: NodeCache, data: bytes, sha: str):
    return cache.acquire(sha, len(data), ".tar", lambda out: out.write(data), f"source-{sha[:6]}")


def cached_keys(root: Path) -> set[str]:
    return {p.name.split(".")[0] for p in (root / "v1").glob("??/*.tar")}


def test_eviction_takes_the_shard_no_plan_reads_again_then_the_furthest(tmp_path):
    (a, sa), (b, sb), (c, sc), (d, sd) = blob("a"), blob("b"), blob("c"), blob("d")
    cache = NodeCache(ShardCache(tmp_path, limit=2000))
    for data, sha in ((a, sa), (b, sb)):
        fill(cache, data, sha).release()
    publisher = PlanPublisher(cache.root)
    publisher.publish([sc, sa], [sd])  # b is read neither this epoch nor the next, though used last
    fill(cache, c, sc).release()
    assert cached_keys(tmp_path) == {sa, sc}
    publisher.publish([sa, sd, sc], [])  # a new epoch: a is read next, then d, then c
    fill(cache, d, sd).release()  # c (distance 2) is further than a (0)
    assert cached_keys(tmp_path) == {sa, sd}
    counts = cache.stats.snapshot()
    assert (counts["evictions_unneeded"], counts["evictions_furthest"], counts["evictions_lru"]) == (1, 1, 0)
    publisher.close()
    assert not list((cache.root / PLANS).iterdir())


def test_a_prefetch_never_evicts_a_shard_needed_sooner(tmp_path):
    (a, sa), (b, sb), (c, sc) = blob("a"), blob("b"), blob("c")
    cache = NodeCache(ShardCache(tmp_path, limit=2000))
    for data, sha in ((a, sa), (b, sb)):
        fill(cache, data, sha).release()
    publisher = PlanPublisher(cache.root)
    publisher.publish([sa, sb, sc], [])  # c is read after a and b: room for it now would cost one of them
    assert fill(cache, c, sc) is None
    assert cached_keys(tmp_path) == {sa, sb}
    counts = cache.stats.snapshot()
    assert counts["evictions"] == counts["bypasses"] == 0  # refused, not bypassed: it is fetched when read
    publisher.advance(2)  # its turn: a and b are done with, so they go
    fill(cache, c, sc).release()
    assert sc in cached_keys(tmp_path)
    publisher.close()


def test_a_prefetch_far_ahead_takes_only_room_to_spare(tmp_path):
    (a, sa), (b, sb), (_, sc), (d, sd) = blob("a"), blob("b"), blob("c"), blob("d")
    cache = NodeCache(ShardCache(tmp_path, limit=2000))
    for data, sha in ((a, sa), (b, sb)):
        fill(cache, data, sha).release()
    publisher = PlanPublisher(cache.root)
    publisher.publish([sa, sc, sd], [sb])  # d is read after a, c; b only next epoch
    assert cache.acquire(sd, len(d), ".tar", lambda out: out.write(d), "d", spare_only=True) is None
    assert cached_keys(tmp_path) == {sa, sb}  # b is needed (next epoch): not room to spare
    publisher.publish([sa, sc, sd], [])  # b is needed by no one now
    cache.acquire(sd, len(d), ".tar", lambda out: out.write(d), "d", spare_only=True).release()
    assert cached_keys(tmp_path) == {sa, sd}
    assert cache.stats.snapshot()["bypasses"] == 0
    publisher.close()


def _publish_and_wait(root: Path, keys: list[str], ready) -> None:
    PlanPublisher(root).publish(keys, [])
    ready.set()
    time.sleep(600)


def test_a_killed_readers_plan_expires_at_the_next_eviction(tmp_path):
    (a, sa), (b, sb), (c, sc) = blob("a"), blob("b"), blob("c")
    cache = NodeCache(ShardCache(tmp_path, limit=2000))
    fill(cache, a, sa).release()
    fill(cache, b, sb).release()
    ready = FORK.Event()
    reader = FORK.Process(target=_publish_and_wait, args=(cache.root, [sc, sa], ready))
    reader.start()
    try:
        assert ready.wait(WAIT_S)
        assert [plan.reads for plan in live_plans(cache.root)] == [(sc, sa)]
        assert next_uses(live_plans(cache.root)) == {sc: 0, sa: 1}
    finally:
        os.kill(reader.pid, signal.SIGKILL)
        reader.join()
    assert len(list((cache.root / PLANS).glob("*.plan"))) == 1  # still on disk, its lock free
    os.utime(cache.root / sa[:2] / f"{sa}.tar.ok", (1, 1))  # a the least recently used
    # Room for c: the dead plan (which would keep a and evict b) is ignored and removed; LRU evicts a.
    fill(cache, c, sc).release()
    assert cached_keys(tmp_path) == {sb, sc}
    assert cache.stats.snapshot()["evictions_lru"] == 1
    assert not list((cache.root / PLANS).iterdir())


def test_a_malformed_plan_of_a_live_reader_is_ignored(tmp_path):
    cache = NodeCache(ShardCache(tmp_path, limit=2000))
    publisher = PlanPublisher(cache.root)
    publisher.path.write_text('{"format": "shardcache.cache-plan", "version": 1, "keys": ["x"], "reads": [5]}')
    assert live_plans(cache.root) == [] and next_uses(live_plans(cache.root)) is None
    publisher.path.write_bytes(b"\xff" * 100)
    assert live_plans(cache.root) == []
    publisher.close()


def test_shard_cache_options_are_checked(tmp_path):
    with pytest.raises(InputError, match="eviction"):
        ShardCache(tmp_path, eviction="random")
    assert ShardCache(tmp_path, prefetch_bytes="1M").prefetch_bytes == 1 << 20


# -- datasets over a cache smaller than the split -------------------------------------------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan-data")
    make_shard_dataset(out, shard_sizes={"train": [PER_SHARD] * SHARDS}, size=(16, 16))
    return out


def digest(sample, seed):
    return hashlib.sha256(sample.data).hexdigest()


def shard_bytes(data: Path) -> list[int]:
    return [p.stat().st_size for p in sorted(data.glob("train-*.tar"))]


def half_limit(data: Path) -> int:
    return sum(sorted(shard_bytes(data))[-SHARDS // 2:])  # room for half of the shards


def open_reader(data: Path, cache: Path | None, limit: int | None = None, source=None, **options):
    remote = shards.Remote(shard_cache=shards.ShardCache(dir=cache, limit=limit, local=True, **options)) \
        if cache is not None else shards.Remote()
    return shards.open_dataset(source if source is not None else data, "train", return_keys=True, seed=7,
                               decode=shards.Decode(decoder=digest), remote=remote,
                               sampling=shards.Sampling(shuffle_buffer=4))


def pairs(batch) -> list[tuple[str, str]]:
    """(key, sha256 of the sample's bytes) of each sample of a batch."""
    return list(zip(batch[2], batch[0]))


def batches(dataset, epoch: int, workers: int = 2) -> list[tuple[str, str]]:
    loader = shards.make_loader(dataset, batch_size=4, mode=workers_mode(workers, persistent=False), drop_last=False)
    loader.set_epoch(epoch)
    return [pair for batch in loader for pair in pairs(batch)]


@pytest.mark.slow
def test_a_limit_below_the_split_yields_the_same_samples_and_resumes_bitwise(data, tmp_path):
    plain = open_reader(data, None)
    tight = open_reader(data, tmp_path / "cache", half_limit(data))
    for epoch in (0, 1, 2):
        assert batches(tight, epoch) == batches(plain, epoch)
    counts = tight.shard_cache.stats.snapshot()
    assert counts["evictions_furthest"] + counts["evictions_unneeded"] > 0 and counts["evictions_lru"] == 0
    full = batches(plain, 3)
    interrupted = shards.make_loader(open_reader(data, tmp_path / "cache", half_limit(data)), batch_size=4,
                                     mode=WorkerProcesses(2, persistent=False), drop_last=False)
    interrupted.set_epoch(3)
    iterator = iter(interrupted)
    head = [pair for _ in range(3) for pair in pairs(next(iterator))]
    state = interrupted.state_dict()
    del iterator
    resumed = shards.make_loader(open_reader(data, tmp_path / "cache", half_limit(data)), batch_size=4,
                                 mode=WorkerProcesses(2, persistent=False), drop_last=False)
    resumed.load_state_dict(state)
    assert head + [pair for batch in resumed for pair in pairs(batch)] == full


@pytest.mark.slow  # over half a second in the quick loop
def test_an_epoch_continued_with_another_worker_count_through_a_tight_cache_yields_the_rest_once(data, tmp_path):
    def loader(workers: int):
        return shards.make_loader(open_reader(data, tmp_path / "cache", half_limit(data)), batch_size=4,
                                  mode=workers_mode(workers, persistent=False), drop_last=False)

    interrupted = loader(2)
    iterator = iter(interrupted)
    head = [pair for _ in range(3) for pair in pairs(next(iterator))]
    state = interrupted.state_dict()
    del iterator
    resumed = loader(1)
    resumed.load_state_dict(state)
    rest = [pair for batch in resumed for pair in pairs(batch)]
    assert sorted(head + rest) == sorted(batches(open_reader(data, None), 0))  # every sample once, bytes intact


@pytest.mark.slow  # over half a second in the quick loop
def test_a_subset_over_a_tight_cache_reads_what_it_reads_without_one(data, tmp_path):
    subset = SourceSpec(data, subset=Subset(classes=["a", "c"]))
    plain = open_reader(data, None, source=subset)
    tight = open_reader(data, tmp_path / "cache", half_limit(data), source=subset)
    for epoch in (0, 1):
        assert batches(tight, epoch) == batches(plain, epoch)


def fetched_per_epoch(data: Path, cache: Path, eviction: str, epochs: int = 4) -> list[int]:
    dataset = open_reader(data, cache, half_limit(data), eviction=eviction)
    fetched = []
    for epoch in range(epochs):
        before = dataset.shard_cache.stats.snapshot()["fetched_bytes"]
        dataset.set_epoch(epoch)
        assert len(list(dataset)) == SHARDS * PER_SHARD
        fetched.append(dataset.shard_cache.stats.snapshot()["fetched_bytes"] - before)
    return fetched


def test_next_use_fetches_about_what_does_not_fit_and_lru_fetches_more(data, tmp_path):
    split = sum(shard_bytes(data))
    by_next_use = fetched_per_epoch(data, tmp_path / "next", "next-use")
    by_lru = fetched_per_epoch(data, tmp_path / "lru", "lru")
    assert by_next_use[0] == by_lru[0] == split  # a cold cache fetches everything once
    floor = split - half_limit(data)
    # The plan looks one epoch ahead: what does not fit crosses the network once per epoch, a shard more at most.
    assert all(floor <= f <= floor + max(shard_bytes(data)) for f in by_next_use[1:]), (by_next_use, floor)
    assert sum(by_next_use[1:]) < sum(by_lru[1:]), (by_next_use, by_lru)


def _rank(data: Path, cache: Path, limit: int, rank: int, results) -> None:
    dataset = shards.open_dataset(data, "train", return_keys=True, seed=7, decode=shards.Decode(decoder=digest),
                                  distributed=shards.Distributed(rank=rank, world_size=2),
                                  remote=shards.Remote(shard_cache=shards.ShardCache(dir=cache, limit=limit,
                                                                                     local=True)))
    out = []
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        out.append([(key, value) for value, _, key in dataset])
    results.put((rank, out))


def test_two_processes_share_a_cache_below_the_split_and_never_exceed_its_limit(data, tmp_path):
    limit = half_limit(data)
    expected = {}
    for rank in (0, 1):
        reference = shards.open_dataset(data, "train", return_keys=True, seed=7,
                                        decode=shards.Decode(decoder=digest),
                                        distributed=shards.Distributed(rank=rank, world_size=2))
        expected[rank] = []
        for epoch in (0, 1):
            reference.set_epoch(epoch)
            expected[rank].append([(key, value) for value, _, key in reference])
    results = FORK.Queue()
    readers = [FORK.Process(target=_rank, args=(data, tmp_path / "cache", limit, r, results)) for r in (0, 1)]
    for reader in readers:
        reader.start()
    largest_seen = 0
    while any(reader.is_alive() for reader in readers) and results.qsize() < 2:
        on_disk = 0
        for path in (tmp_path / "cache" / "v1").glob("??/*"):
            if ".ok" not in path.name:  # shard copies and their temp files; stamps are not counted
                try:
                    on_disk += path.stat().st_size
                except FileNotFoundError:
                    pass
        largest_seen = max(largest_seen, on_disk)
        time.sleep(0.002)
    got = dict(results.get(timeout=WAIT_S) for _ in readers)
    for reader in readers:
        reader.join(WAIT_S)
        assert reader.exitcode == 0
    assert got == expected
    assert 0 < largest_seen <= limit
    assert live_plans(tmp_path / "cache" / "v1") == []  # the readers are gone: so are their plans
    assert not list((tmp_path / "cache" / "v1" / PLANS).iterdir())

