"""The run report's "forecast vs measured" table: per epoch, what the storage forecast said the train reads would
ask of storage (made once as the run started, ``shards.forecast.run``) beside what the run measured, so a reader
sees where reality left the model (docs/caching.md, "Forecast"). Renders the rows as recorded; applies no rule."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from shards.report.html import Markup, count, note, num_cell, number, seconds, size, subsection, table

MAX_ROWS = 2000
# (name in the rows, header, formatter)
NUMBERS = (("requests", "requests", count), ("bytes", "bytes", size), ("hits", "cache hits", count),
           ("misses", "cache misses", count), ("bypasses", "bypasses", count), ("evictions", "evictions", count))


def forecast_part(rows: Sequence[Mapping[str, Any]]) -> Markup:
    """The subsection, or nothing when no row carries a forecast."""
    recorded = [row for row in rows if isinstance(row.get("forecast"), Mapping)][-MAX_ROWS:]
    if not recorded:
        return Markup("")
    present = [entry for entry in NUMBERS if any(entry[0] in row["forecast"] for row in recorded)]
    headers = ["epoch"]
    for _, header, _ in present:
        headers += [f"{header}: forecast", "measured", "off by"]
    headers += ["first batch: forecast", "measured"]
    body = []
    for row in recorded:
        forecast = row["forecast"]
        measured = row.get("storage") if isinstance(row.get("storage"), Mapping) else {}
        cells = [num_cell(row.get("epoch"))]
        for name, _, form in present:
            want, got = number(forecast.get(name)), number(measured.get(name))
            off = None if want is None or got is None or not want else got / want - 1
            cells += [num_cell(want, form), num_cell(got, form), num_cell(off, _signed)]
        cells += [num_cell(forecast.get("first_batch_s"), seconds), num_cell(_first_read(row), seconds)]
        body.append(cells)
    costs = sorted({name for row in recorded for name in (row["forecast"].get("cost") or {})
                    if isinstance(row["forecast"].get("cost"), Mapping)})
    parts = table(headers, body, scroll=len(body) > 12)
    parts += note("Forecast: made from the manifest and the epoch order as the run started (shards plan); measured: "
                  "requests and bytes sent to object storage by the train reads and the train reader's node-cache "
                  "counters, summed over ranks. First batch measured: the epoch's first start's plan and first read "
                  "(plan_s + first_read_s).")
    if costs:
        parts += note(f"The forecast also priced each epoch ({', '.join(costs)}): see metrics.jsonl.")
    return subsection("Storage: forecast vs measured", parts)


def _first_read(row: Mapping[str, Any]) -> float | None:
    """The epoch's first start's plan and first read seconds (``first_batch`` records), or None."""
    starts = row.get("first_batch")
    if not isinstance(starts, list) or not starts or not isinstance(starts[0], Mapping):
        return None
    plan, first = number(starts[0].get("plan_s")), number(starts[0].get("first_read_s"))
    return None if plan is None or first is None else plan + first


def _signed(value: object) -> str:
    share = number(value)
    return "n/a" if share is None else f"{share:+.1%}"
