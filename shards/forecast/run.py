"""A run's forecast beside what the run measured (docs/caching.md, "Forecast").

The forecast itself is made over the run's own train dataset and run mode (``shards.forecast.plan.forecast``), so
the rows it plays are the ones the loader reads; here an epoch of it becomes a metrics.jsonl row
(``epoch_forecast``), and ``compare`` lines it up with the counters the run measured for it (requests and bytes
sent to storage, the node cache's counters, the first batch), so a reader sees where the run left the model.
"""

from __future__ import annotations

from typing import Any, Mapping

from shards.forecast.plan import Forecast

# What metrics.jsonl keeps of an epoch's forecast and of its measurement, side by side (``compare``).
COMPARED = ("requests", "bytes", "hits", "misses", "bypasses", "evictions")


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
