"""The report's section for a training run (a folder with ``metrics.jsonl`` and ``config.json``).

Read from the files a run already writes, never from live training state, so the same page comes out whether
``train-from-shards`` draws it at the end of an epoch or someone runs ``shards report`` on a finished run. Nothing
here imports ``train`` (``shards`` depends on no other package): what a run folder holds is the run record's
(``shards.runrecord``). Whether the data pipeline held an epoch back and what to change, or a rank held the others
back, and the verdicts the section opens with (chance-level accuracy, one class, loss at ln C), are the
training loop's findings (``train.run.diagnose``), recorded in the epoch's row: the report shows it as
recorded and applies no rule of its own. Checkpoints are described from their files' sizes and ``metrics.jsonl``,
never opened: loading them would cost seconds per epoch, and unpickling is not allowed.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from shards.door.bounded_read import read_json_file
from shards.data_events import QUARANTINE, read_events, resume_audits
from shards.errors import ManifestError
from shards.report import svg
from shards.report.curves import find_best_epoch
from shards.report.forecast import forecast_part
from shards.report.memory import memory_part, peak_flight
from shards.report.html import (Cell, Markup, Section, count, figure, fixed, image_data_uri, join, key_value_grid,
                                note, num_cell, number, pct, rate, seconds, size, subsection, table, tag, tiles, void)
from shards.report.mixture import mixture_part, recorded_sources
from shards.report.stages import stage_breakdown
from shards.runrecord import BEST_FILE, CONFIG_FILE, LAST_FILE, METRICS_FILE, MODEL_FILE, read_rows

CHECKPOINTS = ((LAST_FILE, "the latest state; --resume continues from it"),
               (BEST_FILE, "the epoch with the highest val top-1 (regression: the lowest val MSE)"),
               (MODEL_FILE, "the final model: weights, classes, transform"))
MAX_CLASS_BARS = 40
MAX_CONFUSION = 64  # training leaves larger matrices out of metrics.jsonl; a bigger one here is not drawn either
MAX_EPOCH_ROWS = 2000  # also the most classes listed: beyond that a table helps nobody


@dataclass
class RunFiles:
    """A run folder as read: its config (empty when missing), its metrics rows, and lines that did not parse."""

    folder: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    problems: list[str] = field(default_factory=list)


def read_run(folder: Path) -> RunFiles:
    """The run's files, each read whole within ``shards.door.bounded_read``'s bounds: a config.json that cannot be read
    is an error naming it; a metrics.jsonl line that is not a JSON object (malformed, nested too deep) is left out
    and said so on the page."""
    config = read_json_file(folder / CONFIG_FILE) if (folder / CONFIG_FILE).exists() else {}
    if not isinstance(config, dict):
        raise ManifestError("not a JSON object", path=str(folder / CONFIG_FILE))
    problems: list[str] = []
    metrics = folder / METRICS_FILE
    # the rows' own shapes (shards.runrecord.EpochRow), as training reads them back; bad lines left out, said
    rows = [row.to_json() for row in read_rows(metrics, problems=problems)] if metrics.is_file() else []
    return RunFiles(folder, config, rows, problems)


def config_group(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """One option group of a run's config (``train.config.TrainConfig``: ``data``, ``optim``, ...); empty when the
    file, which the report does not trust, holds something else there."""
    group = config.get(name)
    return group if isinstance(group, dict) else {}


def trained_on(config: Mapping[str, Any]) -> list[str]:
    """The folders a run read: every source of a mixture, else its one ``data.path``."""
    data = config_group(config, "data")
    sources = data.get("sources")
    paths = [s.get("path") for s in sources if isinstance(s, dict)] if isinstance(sources, list) and sources \
        else [data.get("path")]
    return [p for p in paths if isinstance(p, str) and p]


def config_items(config: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The config as the report's grid shows it: each group's fields by their dotted path (``optim.lr``), as
    ``--resume`` names a field that differs; the mixture, which has its own part, left out when readable."""
    items = []
    for key, value in config.items():
        if key == "mixture" and recorded_sources(value):
            continue
        if isinstance(value, dict) and key != "mixture":
            items += [(f"{key}.{name}", item) for name, item in value.items()]
        else:
            items.append((key, value))
    return sorted(items)


def findings(row: Mapping[str, Any]) -> list[Markup]:
    """The last epoch's findings, as the training loop recorded them (``EpochRow.wait_advice``,
    ``straggler_warning``): shown, never recomputed."""
    epoch = row.get("epoch")
    return [note(f"Epoch {epoch}: {row[name]}.", "warn") for name in ("wait_advice", "straggler_warning")
            if isinstance(row.get(name), str)]


VERDICT_LEVELS = ("bad", "warn", "good")


def verdict_part(row: Mapping[str, Any]) -> Markup:
    """What a person should conclude, as the training loop recorded it for the last epoch (``EpochRow.verdicts``,
    ``train.run.diagnose.verdicts``): the run section opens with it. A verdict of another shape is left out."""
    recorded = row.get("verdicts")
    shown = [v for v in recorded if isinstance(v, Mapping) and isinstance(v.get("text"), str)
             and v.get("level") in VERDICT_LEVELS] if isinstance(recorded, list) else []
    if not shown:
        return Markup("")
    epoch = row.get("epoch")
    return subsection(f"Verdict (epoch {epoch})", join(note(v["text"] + ".", v["level"]) for v in shown))


def numeric_history(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, float]]:
    """Rows cut down to their finite numbers, for code that would choke on a string where a number belongs."""
    out = []
    for index, row in enumerate(rows):
        clean = {k: number(v) for k, v in row.items()}
        clean = {k: v for k, v in clean.items() if v is not None}
        clean["epoch"] = int(clean.get("epoch", index + 1))
        out.append(clean)
    return out


def is_regression(history: Sequence[Mapping[str, float]]) -> bool:
    """A regression run writes val_mse (and val_r2, val_mae) where a classification run writes val_top1."""
    return any("val_mse" in row for row in history) and not any("val_top1" in row for row in history)


def _scores(history: Sequence[Mapping[str, float]], best: int | None) -> list[tuple[str, str, str | None]]:
    """The overview's first tiles: the last and the best epoch's score."""
    last = history[-1]
    best_row = next((row for row in history if row["epoch"] == best), {})
    at_best = f" (epoch {best})" if best else ""
    if is_regression(history):
        return [("val R², epoch " + str(last["epoch"]), fixed(last.get("val_r2")), None),
                ("best val MSE" + at_best, fixed(best_row.get("val_mse")), "good"),
                ("val R² at best", fixed(best_row.get("val_r2")), None),
                ("val MAE, epoch " + str(last["epoch"]), fixed(last.get("val_mae")), None)]
    return [("val top-1, epoch " + str(last["epoch"]), pct(last.get("val_top1")), None),
            ("best val top-1" + at_best, pct(best_row.get("val_top1")), "good")]


def _overview(run: RunFiles, history: Sequence[Mapping[str, float]]) -> Markup:
    """The headline tiles; the data wait is marked when the loop found it held the last epoch back."""
    if not history:
        return note("No epoch has finished yet: metrics.jsonl is empty or missing.", "warn")
    last = history[-1]
    planned = number(config_group(run.config, "optim").get("epochs"))
    wait = last.get("data_wait_share")
    items = [*_scores(history, find_best_epoch(history)),
             ("epochs", f"{len(history)}" + (f" / {planned:.0f}" if planned else ""), None),
             ("val loss", fixed(last.get("val_loss")), None),
             ("samples/s", count(last.get("samples_per_s")), None),
             _wait_tile(wait, last.get("epoch_time_s"), bool(run.rows[-1].get("wait_advice")))]
    if "val_top5" in last:
        items.insert(2, ("val top-5", pct(last.get("val_top5")), None))
    if any("cache_hit_rate" in row for row in run.rows):
        items.append(("cache hit rate", pct(last.get("cache_hit_rate"), 1), None))
    return tiles(items)


def _wait_tile(share: float | None, epoch_s: float | None, starving: bool) -> tuple[str, str, str | None]:
    """The data-wait tile: marked when the loop found the pipeline held the epoch back; the wait of an epoch too
    short to judge is shown with its length, so a 53% of 10 ms reads as what it is."""
    value = pct(share, 1)
    if share is not None and epoch_s is not None and not starving and share * epoch_s < 1.0:
        value += f" of {seconds(epoch_s)}"
    return ("data wait", value, "warn" if starving else None)


def _curves(history: Sequence[Mapping[str, float]]) -> Markup:
    try:
        from shards.report.curves import curves_bytes

        svg_bytes = curves_bytes(history, fmt="svg")
    except Exception as exc:  # noqa: BLE001 - a figure that cannot be drawn must not cost the rest of the report
        return note(f"Curves unavailable ({type(exc).__name__}: {exc}).", "warn")
    return figure(void("img", src=image_data_uri(svg_bytes, "image/svg+xml"), alt="training curves",
                       class_="curves"),
                  "Loss, top-1 (regression: R²), learning rate, throughput and data-wait share per epoch.")


def _epoch_table(history: Sequence[Mapping[str, float]], rows: Sequence[Mapping[str, Any]]) -> Markup:
    top5 = any("val_top5" in row for row in history)
    cache = any("cache_hit_rate" in row for row in rows)
    scores = ([("val R²", "val_r2", fixed), ("val MSE", "val_mse", fixed), ("val MAE", "val_mae", fixed)]
              if is_regression(history) else
              [("train top-1", "train_top1", pct), ("val top-1", "val_top1", pct),
               *([("val top-5", "val_top5", pct)] if top5 else [])])
    flight = any("memory" in row for row in rows)  # rank 0's peak in flight, beside the data wait
    headers = ["epoch", "train loss", "val loss", *(name for name, _, _ in scores),
               "lr", "samples/s", "data wait", *(["in flight (peak)"] if flight else []), "epoch time",
               *(["cache hits", "fetched", "fetch floor"] if cache else [])]
    body = []
    for row, recorded in list(zip(history, rows))[-MAX_EPOCH_ROWS:]:
        cells = [num_cell(row["epoch"]), num_cell(row.get("train_loss"), fixed), num_cell(row.get("val_loss"), fixed)]
        cells += [num_cell(row.get(key), form) for _, key, form in scores]
        cells += [num_cell(row.get("lr"), rate), num_cell(row.get("samples_per_s")),
                  num_cell(row.get("data_wait_share"), lambda v: pct(v, 1)),
                  *([num_cell(peak_flight(recorded), size)] if flight else []),
                  num_cell(row.get("epoch_time_s"), seconds)]
        counters = row.get("cache") if isinstance(row.get("cache"), Mapping) else {}  # ideal_bytes: what did not fit
        cells += [num_cell(row.get("cache_hit_rate"), lambda v: pct(v, 1)), num_cell(row.get("fetched_bytes"), size),
                  num_cell(counters.get("ideal_bytes"), size)] if cache else []
        body.append(cells)
    return table(headers, body, scroll=len(body) > 12)


def confusion_of(row: Mapping[str, Any]) -> list[list[float]] | None:
    """The row's square confusion matrix of counts, or None when absent or malformed."""
    matrix = row.get("val_confusion")
    if not isinstance(matrix, list) or not matrix or not all(isinstance(r, list) and len(r) == len(matrix)
                                                               for r in matrix):
        return None
    values = [[number(v) for v in r] for r in matrix]
    return None if any(v is None or v < 0 for r in values for v in r) else values  # type: ignore[misc]


def class_names(row: Mapping[str, Any], n: int, classes: Sequence[str] | None) -> tuple[list[str], str]:
    """Names for ``n`` classes and where they came from: the dataset manifest, else the per-class metrics' keys
    (written in class order, sorted like the manifest's classes), else indices."""
    if classes is not None and len(classes) == n:
        return list(classes), "the data's manifest"
    per_class = row.get("val_per_class_accuracy")
    if isinstance(per_class, Mapping) and len(per_class) == n:
        return [str(k) for k in per_class], "metrics.jsonl"
    return [str(i) for i in range(n)], "indices (no class list found)"


def _per_class(row: Mapping[str, Any], classes: Sequence[str] | None) -> Markup:
    matrix = confusion_of(row)
    if matrix is not None and len(matrix) > MAX_CONFUSION:
        matrix = None
    per_class = row.get("val_per_class_accuracy")
    if matrix is None and not isinstance(per_class, Mapping):
        return subsection("Per-class accuracy and confusion", note("Not recorded in metrics.jsonl (runs with more "
                                                                   "than 64 classes leave the matrix out)."))
    n = len(matrix) if matrix is not None else len(per_class)
    names, source = class_names(row, n, classes)
    accuracy = [number(per_class.get(name)) if isinstance(per_class, Mapping) else None for name in names]
    if matrix is not None and all(a is None for a in accuracy):
        accuracy = [r[i] / sum(r) if sum(r) else None for i, r in enumerate(matrix)]
    rows = []
    for i, name in enumerate(names[:MAX_EPOCH_ROWS]):
        confused: Any = ""
        support = None
        if matrix is not None:
            support = sum(matrix[i])
            others = [(v, j) for j, v in enumerate(matrix[i]) if j != i and v > 0]
            if others:
                value, j = max(others)
                confused = f"{names[j]} ({value:,.0f})"
        rows.append([Cell(name), num_cell(accuracy[i], pct), num_cell(support), confused])
    parts = []
    if n <= MAX_CLASS_BARS:
        parts.append(tag("figure", svg.hbars(names, [("val top-1", accuracy)], pct, width=520,
                                             title="per-class accuracy")))
    if matrix is None:
        parts.append(note(f"No confusion matrix in metrics.jsonl (training records it up to {MAX_CONFUSION} "
                          "classes)."))
    else:
        parts.append(figure(svg.heatmap(matrix, names), "Rows: true class; columns: predicted. Colour: share of "
                                                        "the row; numbers: counts."))
    body = tag("div", join(parts), class_="grid2") + table(["class", "val top-1", "val samples",
                                                            "most often predicted instead"], rows, scroll=n > 15)
    body += note(f"Epoch {row.get('epoch', '?')}; class names from {source}.")
    return subsection("Per-class accuracy and confusion", body)


def _cache(history: Sequence[Mapping[str, float]], rows: Sequence[Mapping[str, Any]]) -> Markup:
    if not any("cache_hit_rate" in row for row in rows):
        return Markup("")
    labels = [str(row["epoch"]) for row in history]
    hits = svg.columns(labels, [("hit rate", [row.get("cache_hit_rate") for row in history])], lambda v: pct(v, 0),
                       title="cache hit rate", x_title="epoch", height=200)
    fetched = svg.columns(labels, [("fetched", [row.get("fetched_bytes") for row in history])], size,
                          title="bytes fetched", x_title="epoch", height=200)
    return subsection("Node-local shard cache", tag("div", figure(hits, "Shard reads served from the node's cache.")
                                                    + figure(fetched, "Bytes fetched from the source."),
                                                    class_="grid2"))


def _mtime(path: Path) -> str:
    stamp = _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.timezone.utc)
    return stamp.strftime("%Y-%m-%d %H:%M:%S UTC")


def _checkpoints(folder: Path, history: Sequence[Mapping[str, float]]) -> Markup:
    last = history[-1]["epoch"] if history else None
    epochs = {LAST_FILE: f"after epoch {last}" if last else "n/a",
              BEST_FILE: f"epoch {best}" if (best := find_best_epoch(history)) else "n/a",
              MODEL_FILE: f"final, after epoch {last}" if last else "n/a"}
    rows = []
    for name, meaning in CHECKPOINTS:
        path = folder / name
        if path.is_file():
            rows.append([Cell(str(path), mono=True), num_cell(path.stat().st_size, size), epochs[name], _mtime(path),
                         meaning])
        else:
            rows.append([Cell(str(path), mono=True), "absent", "", "", meaning])
    return subsection("Checkpoints", table(["file", "size", "epoch", "written", "what"], rows, sortable=False)
                      + note("Epochs are read from metrics.jsonl; the checkpoints themselves are not opened."))


QUARANTINE_SHOWN = 10  # quarantined samples named in the report's note; data-events.jsonl lists them all


def _quarantined(folder: Path) -> list[dict[str, Any]]:
    """The run's quarantine events (``shards.data_events``), in the order they happened."""
    return read_events(folder, QUARANTINE)


def _audited(folder: Path) -> list[Markup]:
    """One line on the run's resumes and their resume audit (docs/training.md, "Resume audit"), when it resumed."""
    tally = resume_audits(folder)
    if not tally["resumes"]:
        return []
    line = f"{tally['audited']} resumes audited, {tally['mismatches']} mismatches"
    if tally["audited"] < tally["resumes"]:
        line += f" ({tally['resumes'] - tally['audited']} of {tally['resumes']} not audited: saved without a record)"
    if tally["mismatches"]:
        return [note(f"{line}: {tally['messages'][0]} (shards audit RUN_DIR checks them again).", "warn")]
    return [note(f"{line} (data-events.jsonl; shards audit RUN_DIR checks them again).")]


def run_section(run: RunFiles, anchor: str, *, classes: Sequence[str] | None = None,
                links: Markup | None = None) -> Section:
    """``classes``: the class list of the run's data manifest, when it could be read (names the matrix)."""
    history = numeric_history(run.rows)
    parts = [verdict_part(run.rows[-1]) if run.rows else "", _overview(run, history), links or ""]
    parts += [note(problem, "warn") for problem in run.problems]
    if history:
        parts += findings(run.rows[-1])
        quarantined = _quarantined(run.folder)
        if quarantined:
            shown = ", ".join(f"{e.get('key')} ({e.get('shard')}, {e.get('reason')}, epoch {e.get('epoch')})"
                              for e in quarantined[:QUARANTINE_SHOWN])
            more = f" and {len(quarantined) - QUARANTINE_SHOWN} more" if len(quarantined) > QUARANTINE_SHOWN else ""
            parts.append(note(f"{len(quarantined)} sample(s) quarantined after DataLoader workers hung or died on "
                              f"them twice, and left out from then on: {shown}{more} (data-events.jsonl; stack "
                              "dumps in the run folder).", "warn"))
        parts += _audited(run.folder)
        parts.append(subsection("Curves", _curves(history)))
        parts.append(subsection("Per epoch", _epoch_table(history, run.rows)))
        if not is_regression(history):  # a regression run has no classes to break down
            parts.append(_per_class(run.rows[-1], classes))
        parts.append(stage_breakdown(run.rows))
        parts.append(memory_part(run.rows))
        parts.append(_cache(history, run.rows))
        parts.append(forecast_part(run.rows))
    parts.append(mixture_part(run.config.get("mixture"), run.rows))
    parts.append(_checkpoints(run.folder, history))
    # The mixture has its own part above; as one JSON value in the grid it would be a wall of text.
    config = config_items(run.config)
    parts.append(subsection("Config", key_value_grid(config) if config else note("No config.json.", "warn")))
    return Section(anchor, "run", path=str(run.folder), title=run.folder.name or str(run.folder), body=join(parts))
