"""The forecast against real runs on the local S3 server: the requests and bytes the loader sent (``FETCH_STATS``)
and the node cache's counters, beside what ``shards.forecast.plan.forecast`` said before the run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import shards
from shards.loader.worker_processes import WorkerProcesses
from shards.transport import s3
from tests.forecast_call import forecast_of
from tests.helpers import make_shard_dataset
from tests.s3.test_read import packed

pytestmark = [pytest.mark.s3, pytest.mark.slow]  # slow: starting and stopping SeaweedFS takes seconds

COUNTERS = ("hits", "misses", "bypasses", "evictions")


def measured_epochs(dataset, epochs: int, batch_size: int, workers: int) -> list[dict]:
    """Run ``epochs`` epochs; per epoch the requests and bytes sent to S3 and the node cache's counters."""
    mode = shards.InProcess() if workers == 0 else WorkerProcesses(workers, persistent=False)
    loader = shards.make_loader(dataset, batch_size=batch_size, mode=mode, drop_last=False)
    s3.share_stats()
    out = []
    for epoch in range(epochs):
        s3.FETCH_STATS.reset()
        cache = dataset.shard_cache.stats.snapshot() if dataset.shard_cache is not None else None
        loader.set_epoch(epoch)
        for _ in loader:
            pass
        row = {"requests": s3.FETCH_STATS.requests, "bytes": s3.FETCH_STATS.bytes}
        if cache is not None:
            after = dataset.shard_cache.stats.snapshot()
            row.update({name: after[name] - cache[name] for name in COUNTERS})
        out.append(row)
    return out


def predicted_epochs(result, epochs: int, cached: bool) -> list[dict]:
    rows = []
    for epoch in range(epochs):
        total = result.epoch_total(epoch)
        row = {"requests": total.source.requests, "bytes": total.source.bytes}
        if cached:
            row.update({name: total.cache[name] for name in COUNTERS})
        rows.append(row)
    return rows


def assert_within(predicted: list[dict], measured: list[dict], share: float = 0.02) -> None:
    for forecast_row, real in zip(predicted, measured, strict=True):
        for name in ("requests", "bytes"):
            assert abs(forecast_row[name] - real[name]) <= share * max(real[name], 1), (name, predicted, measured)


@pytest.mark.parametrize("workers", [0, 2])
def test_uncached_epochs_send_the_forecast_requests_and_bytes(bucket, tmp_path: Path, workers: int):
    url = bucket.upload(packed(tmp_path / "data"), "data")
    result = forecast_of(url, epochs=2, workers=workers, batch_size=4, seed=3, read_index=True,
                      persistent=workers == 0)
    dataset = shards.open_dataset(url, transform=lambda image: 0, seed=3)
    measured = measured_epochs(dataset, 2, 4, workers)
    predicted = predicted_epochs(result, 2, cached=False)
    assert_within(predicted, measured)
    assert result.epoch_total(0).read_ahead.requests > 0  # the stream offered later slices before their turn


def test_a_single_process_through_the_cache_hits_exactly_as_forecast(bucket, tmp_path: Path):
    url = bucket.upload(packed(tmp_path / "data"), "data")
    cache = shards.ShardCache(dir=tmp_path / "node-cache", prefetch_bytes=0)
    result = forecast_of(url, epochs=3, workers=1, batch_size=4, seed=1, cache=cache, read_index=True,
                      persistent=False)
    dataset = shards.open_dataset(url, transform=lambda image: 0, seed=1, remote=shards.Remote(shard_cache=cache))
    measured = measured_epochs(dataset, 3, 4, workers=1)
    predicted = predicted_epochs(result, 3, cached=True)
    assert [{k: row[k] for k in COUNTERS} for row in predicted] == [{k: row[k] for k in COUNTERS}
                                                                   for row in measured]
    assert_within(predicted, measured)
    assert measured[0]["misses"] == 3 and measured[1]["hits"] == 3


@pytest.mark.parametrize("eviction", ["next-use", "lru"])
def test_a_cache_under_its_limit_is_forecast_within_the_prefetch_race(bucket, tmp_path: Path, eviction: str):
    """Under the limit, the worker's prefetch thread and its reader race for the room at each epoch's start, and
    which of them evicts first can decide a hit (seen about one run in four on this server): the forecast takes the
    usual outcome, is off by at most one hit an epoch, counts every lookup, and its first, cold epoch is exact."""
    url = bucket.upload(packed(tmp_path / "data"), "data")
    cache = shards.ShardCache(dir=tmp_path / "node-cache", limit=80_000, eviction=eviction, prefetch_bytes=0)
    result = forecast_of(url, epochs=3, workers=1, batch_size=4, seed=1, cache=cache, read_index=True,
                      persistent=False)
    dataset = shards.open_dataset(url, transform=lambda image: 0, seed=1, remote=shards.Remote(shard_cache=cache))
    measured = measured_epochs(dataset, 3, 4, workers=1)
    predicted = predicted_epochs(result, 3, cached=True)
    assert predicted[0] == measured[0]
    for want, got in zip(predicted, measured, strict=True):
        assert abs(want["hits"] - got["hits"]) <= 1 and want["hits"] + want["misses"] == got["hits"] + got["misses"]
    assert sum(row["evictions"] for row in measured) > 0


def test_reads_in_many_parts_stay_within_two_percent(bucket, tmp_path: Path, monkeypatch):
    """Slices read in several ranged parts each (parts made small here, as a real shard's are against its size),
    by two ranks."""
    from shards.transport import parallel_parts

    monkeypatch.setattr(parallel_parts, "MIN_PART", 16 << 10)
    monkeypatch.setattr(parallel_parts, "PART", 32 << 10)
    folder = tmp_path / "data"
    make_shard_dataset(folder, shard_sizes={"train": [40, 25, 33, 18]}, size=(96, 96))
    manifest = json.loads((folder / "dataset.json").read_text())
    for shard in manifest["splits"]["train"]["shards"]:
        index = folder / (shard["path"] + ".idx")
        shard["index"], shard["index_sha256"] = index.name, hashlib.sha256(index.read_bytes()).hexdigest()
    (folder / "dataset.json").write_text(json.dumps(manifest))
    url = bucket.upload(folder, "data")
    options = {"max_concurrency": 4}
    result = forecast_of(url, epochs=1, world_size=2, workers=0, batch_size=8, seed=4, read_index=True,
                      storage_options=options)
    measured = []
    for rank in range(2):
        dataset = shards.open_dataset(url, transform=lambda image: 0, seed=4,
                                      remote=shards.Remote(storage_options=options),
                                      distributed=shards.Distributed(rank=rank, world_size=2))
        measured.append(measured_epochs(dataset, 1, 8, workers=0)[0])
    for rank in range(2):
        part = result.ranks[0][rank]
        assert_within([{"requests": part.source.requests, "bytes": part.source.bytes}], [measured[rank]])
        assert part.source.requests > part.reads + part.index.requests  # slices of several parts each
