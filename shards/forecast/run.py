"""The forecast of a run from its own record, and the forecast beside what the run measured (docs/caching.md,
"Forecast").

A run's data side is recorded as the calls it made (``shards.runrecord.DataCall``: ``open_dataset`` and
``make_loader`` in plain values), so the forecast is made from that record, not from a trainer's options: the same
call that fed the run says what it would read. ``compare`` lines the forecast of an epoch up with the counters the
run measured for it (requests and bytes sent to storage, the node cache's counters, the first batch), so a reader
sees where the run left the model.
"""

from __future__ import annotations

from typing import Any, Mapping

from shards.cache.node import ShardCache
from shards.errors import InputError
from shards.forecast.plan import Forecast, Link, forecast
from shards.forecast.prices import Prices
from shards.runrecord import DataCall

# What metrics.jsonl keeps of an epoch's forecast and of its measurement, side by side (``compare``).
COMPARED = ("requests", "bytes", "hits", "misses", "bypasses", "evictions")


def forecast_of_call(call: DataCall, *, epochs: int, world_size: int, cache: ShardCache | None = None,
                     link: Link | None = None, prices: Prices | None = None) -> Forecast:
    """The forecast of the train loader a run recorded (``call``) over ``epochs`` epochs and ``world_size`` ranks;
    ``cache``: the node cache it reads through (not part of the record: it changes what is fetched, not what is
    fed). A mixture, a subset or class weights are not forecast yet (``InputError``)."""
    opened, loader = call.open_dataset, call.make_loader
    sampling = opened.get("sampling") or {}
    if opened.get("path") is None or sampling.get("class_weights") is not None:
        raise InputError("the forecast covers one dataset read whole (no mixture, subset or class weights)")
    remote = opened.get("remote") or {}
    if remote.get("base_url") is not None:
        raise InputError("the forecast reads shards next to their manifest (no base_url)")
    distributed = opened.get("distributed") or {}
    workers = loader.get("workers")
    return forecast(opened["path"], epochs=epochs, world_size=world_size,
                    workers=workers if isinstance(workers, int) and workers > 0 else 0,
                    batch_size=int(loader["batch_size"]), split=opened.get("split", "train"),
                    seed=int(opened.get("seed", 0)), shuffle=bool(sampling.get("shuffle", True)),
                    drop_last=sampling.get("balance") == "drop",
                    shuffle_buffer=int(sampling.get("shuffle_buffer", 512)),
                    nodes=int(distributed.get("nodes") or 1), rotate_every=int(distributed.get("rotate_every") or 0),
                    cache=cache, link=link, prices=prices,
                    storage_options=remote.get("storage_options"))


def epoch_forecast(result: Forecast, epoch: int) -> dict[str, Any]:
    """Epoch ``epoch`` (from 0) of the forecast as a metrics.jsonl row holds it: the numbers ``compare`` lines up,
    the first batch and the bill."""
    total = result.epoch_total(epoch)
    out: dict[str, Any] = {"requests": total.source.requests, "bytes": total.source.bytes}
    if total.cache:
        out.update({name: int(total.cache[name]) for name in COMPARED[2:]})
    if total.first_batch_s is not None:
        out["first_batch_s"] = round(total.first_batch_s, 4)
    cost = result.cost(total.source)
    if cost is not None:
        out["cost"] = cost
    return out


def compare(forecast_row: Mapping[str, Any], measured: Mapping[str, Any]) -> list[tuple[str, Any, Any, float | None]]:
    """``(name, forecast, measured, measured / forecast - 1)`` for each number both hold (None: no ratio)."""
    lines = []
    for name in COMPARED:
        if name in forecast_row and name in measured:
            want, got = forecast_row[name], measured[name]
            lines.append((name, want, got, None if not want else got / want - 1))
    return lines
