"""The forecast (``shards.forecast``): from the plan alone, what each epoch asks of storage, in agreement with what a
real run of the loader does, and a price file read through the door."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import shards
from shards.cache.node import ShardCache
from shards.errors import InputError
from shards.forecast.plan import Link
from shards.forecast.prices import GB, PriceTable, load_prices, prices_from
from shards.forecast.requests import AHEAD_READS, ShardSpans, Traffic, ranged_sizes, whole_object_sizes
from shards.manifest import load_manifest
from shards.order.order import EpochSource, Layout, worker_order
from shards.transport import parallel_parts
from tests.forecast_call import forecast_of
from tests.helpers import make_shard_dataset

EXAMPLE_PRICES = Path(__file__).resolve().parents[2] / "docs" / "prices-s3-example.json"


def indexed(folder: Path, sizes: list[int]) -> Path:
    """A tar dataset whose manifest records each shard's byte index (as pack-shards records it)."""
    make_shard_dataset(folder, shard_sizes={"train": sizes}, size=(16, 16))
    manifest = json.loads((folder / "dataset.json").read_text())
    for shard in manifest["splits"]["train"]["shards"]:
        index = folder / (shard["path"] + ".idx")
        shard["index"] = index.name
        shard["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    (folder / "dataset.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return indexed(tmp_path_factory.mktemp("forecast") / "data", [7, 5, 9, 3, 6])


def test_every_rank_reads_its_share_of_the_one_order(data):
    result = forecast_of(str(data), epochs=2, world_size=3, workers=2, batch_size=2, seed=5)
    info = load_manifest(data).splits["train"]
    source = EpochSource(tuple(info.shard_sizes), 5, True, 512, False, None)
    for epoch in range(2):
        for rank in range(3):
            expected = sum(len(worker_order(source, Layout(3, 1, 2, 2), epoch, rank, w).rows) for w in range(2))
            assert result.ranks[epoch][rank].samples == expected
    assert result.epoch_total(0).samples == 30  # 30 samples over 3 ranks: no padding needed


def test_a_local_dataset_reads_each_slice_once_and_exact_spans_are_its_bytes(data):
    exact = forecast_of(str(data), epochs=1, workers=0, batch_size=4, shuffle=False, read_index=True)
    total = exact.epoch_total(0)
    info = load_manifest(data).splits["train"]
    ends = [int(np.fromfile(data / (s.path + ".idx"), dtype="<u8", offset=16)[-1]) for s in info.shards]
    assert total.reads == len(info.shards) and total.local.requests == len(info.shards)
    assert total.local.bytes == sum(ends)  # one unshuffled pass reads every sample's bytes once
    assert total.source.requests == 0  # nothing of it is object storage
    estimate = forecast_of(str(data), epochs=1, workers=0, batch_size=4, shuffle=False).epoch_total(0)
    assert estimate.local.requests == total.local.requests
    assert abs(estimate.local.bytes - total.local.bytes) <= len(info.shards) * 5 * 1024


def test_an_unlimited_cache_misses_each_shard_once_then_only_hits(data):
    result = forecast_of(str(data), epochs=3, workers=1, batch_size=4, cache=ShardCache(local=True))
    first, second = result.epoch_total(0), result.epoch_total(1)
    assert first.cache["misses"] == 5 and first.cache["hits"] == 0
    assert second.cache["misses"] == 0 and second.cache["hits"] == second.reads
    assert first.local.requests == 5 and second.local.requests == 0  # each shard copied in once


def run_cached(data: Path, tmp_path: Path, cache: ShardCache, epochs: int, seed: int) -> list[dict]:
    """A real in-process run through the node cache: each epoch's counters."""
    dataset = shards.open_dataset(data, transform=lambda image: 0, seed=seed,
                                  remote=shards.Remote(shard_cache=cache))
    loader = shards.make_loader(dataset, batch_size=4, mode=shards.InProcess(), drop_last=False)
    counts = []
    for epoch in range(epochs):
        before = dataset.shard_cache.stats.snapshot()
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        after = dataset.shard_cache.stats.snapshot()
        counts.append({k: after[k] - before[k] for k in ("hits", "misses", "bypasses", "evictions")})
    return counts


def predicted_counts(data: Path, cache: ShardCache, epochs: int, seed: int) -> list[dict]:
    result = forecast_of(str(data), epochs=epochs, workers=0, batch_size=4, seed=seed, cache=cache)
    return [{k: result.epoch_total(e).cache[k] for k in ("hits", "misses", "bypasses", "evictions")}
            for e in range(epochs)]


@pytest.mark.slow
def test_a_single_process_cache_forecast_is_exact(data, tmp_path):
    cache = ShardCache(dir=tmp_path / "cache", local=True, prefetch_bytes=0)
    measured = run_cached(data, tmp_path, cache, epochs=3, seed=2)
    assert predicted_counts(data, cache, 3, 2) == measured
    assert measured[0]["misses"] == 5 and measured[1]["hits"] == 5


@pytest.mark.slow
@pytest.mark.parametrize("eviction, prefetch", [("next-use", 0), ("lru", 0), ("next-use", 64 << 10)])
def test_a_cache_under_its_limit_is_forecast_within_the_prefetch_race(data, tmp_path, eviction, prefetch):
    """Under the limit, the reader's prefetch thread and the reader itself race for the room (a deeper prefetch
    also runs while the reader reads on): which evicts first can decide a hit. The forecast takes the usual
    outcome (its counts are the measured ones on a quiet machine), is off by at most one hit an epoch on a busy
    one, counts every lookup, and its cold first epoch is exact."""
    cache = ShardCache(dir=tmp_path / "cache", limit=90_000, local=True, eviction=eviction, prefetch_bytes=prefetch)
    measured = run_cached(data, tmp_path, cache, epochs=3, seed=2)
    predicted = predicted_counts(data, cache, 3, 2)
    assert predicted[0] == measured[0]  # a cold first epoch has nothing to race for
    for want, got in zip(predicted, measured, strict=True):
        assert abs(want["hits"] - got["hits"]) <= 1 and want["hits"] + want["misses"] == got["hits"] + got["misses"]
    assert sum(epoch["evictions"] for epoch in measured) > 0  # the limit was felt: eviction was played


def test_next_uses_is_each_keys_nearest_read_over_all_plans():
    """The cache's next-use table (which the forecast asks thousands of times an epoch), against the rule said
    plainly: per key, the fewest reads ahead of a plan's position at which any plan reads it."""
    from shards.cache.plan_view import Plan, next_uses

    rng = np.random.default_rng(7)
    assert next_uses([]) is None
    for _ in range(300):
        plans = []
        for _ in range(int(rng.integers(1, 5))):
            reads = tuple(f"{int(k):064x}" for k in rng.integers(0, 6, int(rng.integers(0, 10))))
            plans.append(Plan(reads, int(rng.integers(0, len(reads) + 1)), len(reads)))
        plain: dict[str, int] = {}
        for plan in plans:
            for distance, key in enumerate(plan.reads[plan.position:]):
                plain[key] = min(plain.get(key, distance), distance)
        assert next_uses(plans) == plain


def test_ranged_reads_are_cut_as_the_transport_cuts_them():
    for length in (1, 3 << 20, 4 << 20, 33 << 20, (64 << 20) + 5):
        sizes = ranged_sizes(length, 8)
        part = parallel_parts.part_length(length, 8)
        assert sum(sizes) == length and len(sizes) == len(range(0, length, part))
    assert whole_object_sizes(3 << 20, 8)[0] == parallel_parts.FIRST_PART
    assert sum(whole_object_sizes(3 << 20, 8)) == 3 << 20
    assert whole_object_sizes(1000, 8) == [1000]


def test_the_read_ahead_window_is_the_streams():
    from shards.stream import image_dataset

    assert AHEAD_READS == image_dataset.AHEAD_READS


def test_spans_estimate_leaves_out_the_tar_end():
    spans = ShardSpans([20480], [10])
    assert spans.span(0, 0, 10) < 20480 - 1024
    assert spans.span(0, 0, 5) * 2 == pytest.approx(spans.span(0, 0, 10), abs=2)


def test_the_time_to_first_batch_counts_round_trips_and_bytes(data):
    slow = forecast_of(str(data), epochs=1, workers=1, batch_size=4, link=Link(request_ms=100.0, mbps=8.0))
    fast = forecast_of(str(data), epochs=1, workers=1, batch_size=4, link=Link(request_ms=1.0, mbps=8000.0))
    assert slow.epoch_total(0).first_batch_s > fast.epoch_total(0).first_batch_s > 0
    assert forecast_of(str(data), epochs=1, batch_size=4).epoch_total(0).first_batch_s is None


def test_the_example_prices_load_and_bill_requests_and_bytes():
    prices = load_prices(EXAMPLE_PRICES)
    assert prices.date and {t.name for t in prices.tables} >= {"s3-standard-in-region", "s3-express-one-zone"}
    traffic = Traffic()
    traffic.add([GB] * 1000)
    table = PriceTable("t", per_1000_requests=0.5, per_gb=0.01, per_gb_over=1.0, free_bytes_per_request=GB // 2)
    assert table.cost(traffic) == pytest.approx(0.5 + 1000 * 0.01 + 1000 * 0.5)


@pytest.mark.parametrize("change, message", [
    ({"version": 2}, "shardcache.prices"),
    ({"tables": {"a": {"per_1000_requests": "0.4", "per_gb": 0}}}, "tables.a.per_1000_requests"),
    ({"tables": {"a": {"per_1000_requests": -1, "per_gb": 0}}}, "tables.a.per_1000_requests"),
    ({"tables": {"a": {"per_gb": 0}}}, "tables.a.per_1000_requests is missing"),
    ({"tables": {"a": {"per_1000_requests": 1, "per_gb": 0, "extra": 1}}}, "unknown field 'extra'"),
    ({"tables": {}}, "0 tables"),
    ({"surprise": 1}, "unknown field 'surprise'"),
])
def test_a_bad_price_file_is_one_line_naming_the_field(change, message):
    good = json.loads(EXAMPLE_PRICES.read_text())
    with pytest.raises(InputError, match=message) as caught:
        prices_from({**good, **change}, "prices.json")
    assert "\n" not in str(caught.value) and "prices.json" in str(caught.value)


def test_the_plan_command_prints_json_and_a_table(data, tmp_path):
    from shards.cli.main import main

    result = CliRunner().invoke(main, ["plan", str(data), "--epochs", "2", "--batch-size", "4", "--workers", "1",
                                       "--cache-limit", "100K", "--cache-local", "--prices", str(EXAMPLE_PRICES),
                                       "--request-ms", "20", "--mbps", "1000"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["format"] == "shardcache.forecast" and len(out["epochs"]) == 2
    assert set(out["cost"]) == {"s3-standard-in-region", "s3-standard-internet", "s3-express-one-zone"}
    assert "first batch" in result.stderr
    bad = tmp_path / "prices.json"
    bad.write_text('{"format": "shardcache.prices", "version": 1, "date": "x", "tables": {"a": {"per_gb": 1}}}')
    refused = CliRunner().invoke(main, ["plan", str(data), "--epochs", "1", "--batch-size", "4", "--prices", str(bad)])
    assert refused.exit_code != 0 and "per_1000_requests is missing" in refused.stderr
    assert "Traceback" not in refused.output
