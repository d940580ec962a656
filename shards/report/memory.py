"""The run report's "memory in flight" part: the loader's memory over an epoch beside the data wait of the same
intervals (issue 46), as the training loop sampled it (``EpochRow.memory``, ``train.run.meter.MemoryTrace``).

The flight is the process tree's memory (PSS plus ``/dev/shm``, ``shards.procs.memory``) above its sample as the
epoch's loop started, so a first epoch's also holds the worker processes it started. Read side by side: memory
that passes the budget is a budget that does not hold; a budget that holds while the wait climbs is one too small
for the step. Renders the recorded numbers and applies no rule; a trace of another shape is left out.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from shards.report import svg
from shards.report.html import Markup, figure, note, number, pct, size, subsection, tag

BUDGET_IN_SIGHT = 4  # the budget is drawn as a line when at most this many times the peak


def _numbers(value: Any, length: int) -> list[float] | None:
    """A recorded list of ``length`` numbers, or None."""
    if not isinstance(value, list) or len(value) != length:
        return None
    numbers = [number(v) for v in value]
    return None if any(v is None for v in numbers) else numbers  # type: ignore[return-value]


def trace(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """A row's memory trace as numbers: ``t_s``, the flight above the start (``flight``) and the training process's
    part of it (``main``: None when not recorded), ``wait_share`` (None where not measured), ``budget`` (or None)
    and ``peak``; None when absent or malformed."""
    recorded = row.get("memory")
    if not isinstance(recorded, Mapping) or not isinstance(recorded.get("t_s"), list) or not recorded["t_s"]:
        return None
    length = len(recorded["t_s"])
    times, values = _numbers(recorded["t_s"], length), _numbers(recorded.get("bytes"), length)
    start = number(recorded.get("start_bytes"))
    if times is None or values is None or start is None:
        return None
    shares = recorded.get("wait_share")
    shares = [number(s) for s in shares] if isinstance(shares, list) and len(shares) == length else [None] * length
    flight = [max(0.0, v - start) for v in values]
    main = _numbers(recorded.get("main_bytes"), length)
    if main is not None:  # the training process's growth, within the tree's
        main = [min(max(0.0, v - main[0]), whole) for v, whole in zip(main, flight)]
    budget = number(recorded.get("budget_bytes"))
    return {"t_s": times, "flight": flight, "main": main, "wait_share": shares,
            "budget": budget if budget and budget > 0 else None, "peak": max(flight)}


def peak_flight(row: Mapping[str, Any]) -> float | None:
    """The epoch's peak memory in flight, for the per-epoch table's column beside the data wait."""
    found = trace(row)
    return None if found is None else found["peak"]


def memory_part(rows: Sequence[Mapping[str, Any]]) -> Markup:
    """The subsection for the last epoch with a trace, or nothing when no row carries one."""
    traced = [(row, found) for row in rows if (found := trace(row)) is not None]
    if not traced:
        return Markup("")
    row, found = traced[-1]
    labels = [f"{t:.0f}" for t in found["t_s"]]
    budget = found["budget"]
    # The budget's line where it is within sight of the flight: a default of a quarter of the machine would flatten
    # the columns to nothing (the note states it instead).
    shown = budget is not None and budget <= BUDGET_IN_SIGHT * max(found["peak"], 1.0)
    threshold = (budget, f"budget {size(budget)}") if shown else None
    main = found["main"]
    series = [("in flight", found["flight"])] if main is None else [
        ("training process", main), ("worker processes, /dev/shm", [f - m for f, m in zip(found["flight"], main)])]
    flight = svg.columns(labels, series, size, stacked=True, threshold=threshold,
                         colours=["#4c78a8", "#f58518"][:len(series)], title="memory in flight over the epoch",
                         x_title="seconds into the epoch", height=220)
    wait = svg.columns(labels, [("data wait", found["wait_share"])], lambda v: pct(v, 0),
                       colours=["#e45756"], title="data wait over the epoch", x_title="seconds into the epoch",
                       height=220, axis_fmt=lambda v: pct(v, 1))  # a steady loop waits well under 1%
    over = f" of a {size(budget)} budget" if budget is not None else ""
    body = tag("div", figure(flight, "Memory in flight: the process tree's PSS plus /dev/shm above the epoch's "
                                     "start, as the loop sampled it; in threads or in process the loader's part "
                                     "is the training process's, beside what the step itself holds.")
               + figure(wait, "Data wait: the share of each interval the loop waited for its next batch."),
               class_="grid2")
    body += note(f"Epoch {row.get('epoch', '?')}: peak {size(found['peak'])} in flight{over} "
                 f"({len(found['t_s'])} samples; under torchrun, rank 0's).")
    return subsection("Memory in flight and data wait", body)
