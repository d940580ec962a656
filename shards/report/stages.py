"""Where an epoch's time went: the stage breakdown of ``metrics.jsonl`` rows, as stacked bars and shares.

Rows may carry ``stage_seconds`` ({stage: seconds}) and, from a distributed run, ``stage_seconds_by_rank`` (one
such mapping per rank). A slow rank holds every other one at the next all-reduce, so with several ranks the last
epoch is also shown rank by rank, with each epoch's slowest rank and whether it waited for data or computed, as the
training loop found and recorded it (``shards.runrecord.EpochRow``: ``slowest_rank``... ``straggler``). A row
without stage seconds says so instead of showing an empty chart; one-process runs have no ranks to compare.

Rows may also carry ``first_batch``: one record per start or resume of the run in that epoch (``train.run.first_batch``:
the seconds to the first batch, split into open, plan, first read and other), shown as a table of starts.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from shards.report import svg
from shards.report.html import (Markup, count, figure, join, note, num_cell, number, pct, seconds, subsection, table,
                                tag)

# The names are the contract of shards.procs.stage_times (not imported: it loads torch). Worker stages are busy
# seconds summed over a rank's DataLoader workers and overlap the loop; loop stages are the loop's wall seconds.
WORKER_STAGES = ("read", "decode", "transform", "collate")
LOOP_STAGES = ("wait", "to_device", "normalize", "step")
STAGES = WORKER_STAGES + LOOP_STAGES
# Fixed colours, so a stage looks the same in every chart and every report: waiting red, useful compute green.
STAGE_COLOURS = {"read": "#4c78a8", "decode": "#f58518", "transform": "#eeca3b", "collate": "#b279a2",
                 "wait": "#e45756", "to_device": "#72b7b2", "normalize": "#9d755d", "step": "#54a24b"}


def _seconds_map(value: Any) -> dict[str, float] | None:
    from shards.report.html import number

    if not isinstance(value, Mapping):
        return None
    parsed = {str(k): number(v) for k, v in value.items()}
    return {k: v for k, v in parsed.items() if v is not None and v >= 0}


def by_rank(row: Mapping[str, Any]) -> list[dict[str, float]] | None:
    """The row's per-rank stage seconds in rank order, or None."""
    value = row.get("stage_seconds_by_rank")
    if isinstance(value, Mapping):
        try:
            value = [value[k] for k in sorted(value, key=lambda k: int(k))]
        except (TypeError, ValueError):
            return None
    if not isinstance(value, list) or not value:
        return None
    ranks = [_seconds_map(item) for item in value]
    return None if any(r is None for r in ranks) else ranks  # type: ignore[return-value]


def recorded_straggler(row: Mapping[str, Any]) -> dict[str, Any] | None:
    """The epoch's slowest rank as the loop recorded it, or None (one process, or none recorded)."""
    if type(row.get("slowest_rank")) is not int or not isinstance(row.get("slowest_rank_cause"), str):
        return None
    seconds_fields = ("slowest_rank_wait_s", "others_wait_s", "slowest_rank_wait_ratio", "slowest_rank_step_s",
                      "others_step_s")
    return {"rank": row["slowest_rank"], "cause": row["slowest_rank_cause"],
            **{name: number(row.get(name)) for name in seconds_fields}}


def stage_seconds(row: Mapping[str, Any]) -> dict[str, float] | None:
    """The row's stage seconds, summed over ranks (as training writes them); from per-rank rows alone, their sum."""
    own = _seconds_map(row.get("stage_seconds"))
    if own is not None:
        return own
    ranks = by_rank(row)
    if ranks is None:
        return None
    names = {name for rank in ranks for name in rank}
    return {name: sum(rank.get(name, 0.0) for rank in ranks) for name in names}


MAX_EXTRA_STAGES = 8
MAX_STRAGGLER_ROWS = 2000  # epochs listed in the slowest-rank table (the rows are untrusted)
MAX_STARTS = 200  # starts and resumes listed: a run resumed more often than this shows its latest ones
# train.run.first_batch's record: the total, then the parts that add up to it.
FIRST_BATCH_PARTS = (("first batch", "first_batch_s"), ("open", "open_s"), ("plan", "plan_s"),
                     ("first read", "first_read_s"), ("other", "other_s"))


def ordered_stages(maps: Sequence[Mapping[str, float]]) -> list[str]:
    """The known stages in pipeline order, then a few others a newer writer may add (never hundreds: the rows are
    untrusted)."""
    seen = {name for m in maps for name in m}
    return [s for s in STAGES if s in seen] + sorted(seen - set(STAGES))[:MAX_EXTRA_STAGES]


def _colours(names: Sequence[str]) -> list[str]:
    extra = iter(("#bab0ac", "#ff9da6", "#17becf", "#7f7f7f", "#bcbd22"))
    return [STAGE_COLOURS.get(name) or next(extra, "#999999") for name in names]


def _rank_table(ranks: Sequence[Mapping[str, float]], names: Sequence[str]) -> Markup:
    rows = []
    for index, rank in enumerate(ranks):
        loop = sum(rank.get(n, 0.0) for n in LOOP_STAGES)
        rows.append([num_cell(index), *[num_cell(rank.get(n), seconds) for n in names], num_cell(loop, seconds),
                     num_cell(rank.get("wait", 0.0) / loop if loop else None, lambda v: pct(v, 1))])
    return table(["rank", *names, "loop total", "wait share of loop"], rows)


def _axis_seconds(value: float) -> str:
    return f"{value:g} s"


def _shares(last: Mapping[str, float], group: Sequence[str], names: Sequence[str], fills: Sequence[str],
            title: str) -> Markup:
    parts = [(n, last.get(n, 0.0), f) for n, f in zip(names, fills) if n in group]
    if not sum(value for _, value, _ in parts):
        return tag("h4", title) + note("No time recorded here (no DataLoader workers timed this epoch).")
    return tag("h4", title) + svg.share_bar(parts, lambda v: pct(v, 1), width=520, title=title)


def _per_rank(ranks: Sequence[Mapping[str, float]], row: Mapping[str, Any]) -> list[Markup]:
    names = ordered_stages(ranks)
    epoch = row.get("epoch")
    chart = svg.columns([f"rank {i}" for i in range(len(ranks))], [(n, [r.get(n, 0.0) for r in ranks]) for n in names],
                        seconds, axis_fmt=_axis_seconds, stacked=True, colours=_colours(names), width=620,
                        height=220, title="last epoch's stage seconds per rank")
    parts = [tag("h3", f"Epoch {epoch}: per rank ({len(ranks)} ranks)"), tag("figure", chart),
             _rank_table(ranks, names)]
    if isinstance(row.get("straggler"), str):
        parts.append(note(f"Slowest rank: {row['straggler']}. Every rank waits for the slowest at each gradient "
                          "all-reduce, so the others' extra seconds show in their step.",
                          "warn" if row.get("slowest_rank_cause") == "data" else "info"))
    return parts


def _ratio(value: Any) -> str:
    return "others did not wait" if number(value) is None else f"{value:.1f}x"


def _stragglers(rows: Sequence[Mapping[str, Any]]) -> Markup:
    """Each distributed epoch's slowest rank (the warning when one held the others back is at the top of the run's
    section, ``shards.report.run``)."""
    epochs = [(row, recorded_straggler(row)) for row in rows[-MAX_STRAGGLER_ROWS:]]
    epochs = [(row, s) for row, s in epochs if s is not None]
    if not epochs:
        return Markup("")
    body = [[num_cell(row.get("epoch")), num_cell(s["rank"]), s["cause"], num_cell(s["slowest_rank_wait_s"], seconds),
             num_cell(s["others_wait_s"], seconds), num_cell(s["slowest_rank_wait_ratio"], _ratio),
             num_cell(s["slowest_rank_step_s"], seconds), num_cell(s["others_step_s"], seconds)] for row, s in epochs]
    return (tag("h3", "Slowest rank per epoch")
            + table(["epoch", "slowest rank", "cause", "its wait", "others' mean wait", "wait ratio", "its step",
                     "others' mean step"], body, scroll=len(body) > 12)
            + note("The training loop's verdict: a rank whose data wait stands out from the others' is the data "
                   "straggler; otherwise the epoch is bound by compute and the rank with the most step seconds is "
                   "named (the all-reduce evens step times out, so that name is weak)."))


def first_batch_records(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Every start's and resume's record, in run order (malformed ones left out: the rows are untrusted)."""
    records = []
    for row in rows:
        value = row.get("first_batch")
        if isinstance(value, list):
            records += [r for r in value if isinstance(r, Mapping) and number(r.get("first_batch_s")) is not None]
    return records[-MAX_STARTS:]


def first_batch_table(rows: Sequence[Mapping[str, Any]]) -> Markup:
    """Time to first batch of each start and resume, or nothing for runs from before it was recorded."""
    records = first_batch_records(rows)
    if not records:
        return Markup("")
    body = []
    for record in records:
        resumed = record.get("resume") is True
        where = f"epoch {count(record.get('epoch'))}, step {count(record.get('step'))}"
        body.append(["resume" if resumed else "start", where,
                     *[num_cell(record.get(key), seconds) for _, key in FIRST_BATCH_PARTS],
                     num_cell(record.get("workers"))])
    caption = ("Seconds from the start (or resume) of train-from-shards to the training loop's first batch: open "
               "is open_dataset for train and val; plan and first read split the loop's wait for the batch (with "
               "DataLoader workers, first read is their recorded busy seconds divided by their number, an "
               "estimate; plan the rest: starting workers, the epoch order, covering reads); other is imports, "
               "checks, model and checkpoint restore. Rank 0's numbers.")
    return (tag("h3", "Time to first batch")
            + table(["start", "at", *[name for name, _ in FIRST_BATCH_PARTS], "workers"], body,
                    scroll=len(body) > 12)
            + note(caption))


def run_mode_table(rows: Sequence[Mapping[str, Any]]) -> Markup:
    """The train loader's run mode, and with ``Auto`` the trial that chose it: per candidate the batches timed
    and the mean step and data-wait seconds, which were cut short and which two ran off (``shards.loader.auto``). Nothing for runs from
    before it was recorded."""
    recorded = [row["run_mode"] for row in rows if isinstance(row.get("run_mode"), Mapping)]
    if not recorded:
        return Markup("")
    last = recorded[-1]
    trial = last.get("trial") if isinstance(last.get("trial"), list) else []
    if not trial:
        return tag("h3", "Run mode") + note(f"The train loader ran as {last.get('mode')}.")
    chosen = last.get("chosen")
    listed = last.get("runoff") if isinstance(last.get("runoff"), list) else []  # older runs have none
    runoff = [mode for mode in listed if isinstance(mode, str)]
    listed = last.get("cut") if isinstance(last.get("cut"), list) else []
    cut = [mode for mode in listed if isinstance(mode, str)]

    def role(mode: Any) -> str:
        return ", ".join(word for word, yes in (("cut short", mode in cut), ("ran off", mode in runoff),
                                                ("chosen", mode == chosen)) if yes)

    body = [[str(entry.get("mode")), num_cell(entry.get("batches")), num_cell(number(entry.get("step_s")), seconds),
             num_cell(number(entry.get("wait_s")), seconds), role(entry.get("mode"))]
            for entry in trial if isinstance(entry, Mapping)]
    over = (" of the two ran off (within the runoff margin of each other, both timed again in the reverse order)"
            if len(runoff) == 2 else "")
    if cut:
        over += "; a candidate cut short was half again as slow as one timed before it, after 3 batches"
    verdict = (f"Chosen: {chosen}, the lowest mean step time (data wait plus step) over the batches timed{over}."
               if chosen else "Every candidate had not been timed yet when the run ended: no mode was chosen.")
    return (tag("h3", "Run mode (auto)")
            + table(["candidate", "batches timed", "mean step", "mean data wait", ""], body)
            + note(f"{verdict} Every candidate feeds the same batches (one plan, one saved-state layout); the trial "
                   "ran at the start of the first epoch."))


def stage_breakdown(rows: Sequence[Mapping[str, Any]]) -> Markup:
    """Stacked seconds per epoch, the last epoch's shares (loop and workers apart: worker time overlaps the loop),
    and the last epoch rank by rank when there are several ranks."""
    timed = [(row, stage_seconds(row)) for row in rows]
    timed = [(row, m) for row, m in timed if m]
    if not timed:
        return subsection("Stage breakdown", note("Not recorded: this run's metrics.jsonl has no stage_seconds "
                                                  "(runs from before stage timing).") + first_batch_table(rows)
                          + run_mode_table(rows))
    names = ordered_stages([m for _, m in timed])
    fills = _colours(names)
    labels = [str(row.get("epoch", i + 1)) for i, (row, _) in enumerate(timed)]
    per_epoch = svg.columns(labels, [(n, [m.get(n, 0.0) for _, m in timed]) for n in names], seconds, stacked=True,
                            axis_fmt=_axis_seconds, colours=fills, title="stage seconds per epoch", x_title="epoch",
                            width=560, height=260)
    last_row, last = timed[-1]
    epoch = last_row.get("epoch", len(timed))
    loop_total = sum(last.get(n, 0.0) for n in LOOP_STAGES)
    worker_total = sum(last.get(n, 0.0) for n in WORKER_STAGES)
    share_rows = []
    for n in names:
        group, total = ("loop", loop_total) if n in LOOP_STAGES else ("workers", worker_total)
        share = last.get(n, 0.0) / total if total else None
        share_rows.append([n, group, num_cell(last.get(n), seconds), num_cell(share, lambda v: pct(v, 1))])
    shares = (tag("h3", f"Epoch {epoch}: where the time went")
              + _shares(last, LOOP_STAGES, names, fills, "training loop (wall time)")
              + _shares(last, WORKER_STAGES, names, fills, "loader workers (busy time, overlaps the loop)")
              + table(["stage", "part", "seconds", "share of part"], share_rows))
    caption = ("Seconds per stage and epoch, summed over ranks. Worker stages (read, decode, transform, collate) "
               "run in DataLoader workers alongside the loop (wait, to_device, normalize, step), so the stack can "
               "exceed the epoch's wall time.")
    body = [tag("div", figure(per_epoch, caption) + tag("div", shares), class_="grid2")]
    ranks = by_rank(last_row)
    if ranks and len(ranks) > 1:
        body += _per_rank(ranks, last_row)
    body.append(_stragglers([row for row, _ in timed]))
    body.append(first_batch_table(rows))
    body.append(run_mode_table(rows))
    return subsection("Stage breakdown", join(body))
