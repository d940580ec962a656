"""The run report's data mixture: what each epoch of a mixed or subset training set held, source by source.

``train-from-shards`` records the mixture it streamed in ``config.json`` (``"mixture": {"class_map", "epoch_size",
"sources": [...]}``, each source as ``shards.select.mixture.Mixture.composition`` describes it) and, per epoch, the
samples each source filled in ``metrics.jsonl`` (``"mixture_drawn": [n, ...]``, in source order). Both are
untrusted: a value that is not what it should be shows as n/a, and at most ``MAX_SOURCES`` sources and
``MAX_CLASS_ROWS`` classes are listed.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from shards.check.inspect import describe_amount, describe_subset
from shards.report import svg
from shards.report.html import (Cell, Markup, count, figure, fixed, join, note, num_cell, number, pct, subsection,
                                table, tag)

MAX_SOURCES = 64
MAX_CLASS_ROWS = 2000
MAX_EPOCH_COLUMNS = 200  # the chart's last epochs; the table lists them all
CLASS_MAPS = {"same": "every source has the same class list",
              "union": "each source's labels are mapped by name onto the sorted union of the sources' classes"}


def source_names(sources: Sequence[Mapping[str, Any]], n: int) -> list[str]:
    """``1 name``, ``2 name``...: the number keeps two folders of one name apart, the name says which it is."""
    names = []
    for i in range(n):
        path = sources[i].get("path") if i < len(sources) else None
        tail = str(path).rstrip("/").rsplit("/", 1)[-1] if isinstance(path, str) and path else ""
        names.append(f"{i + 1} {tail}".strip() if tail else f"source {i + 1}")
    return names


def recorded_sources(mixture: Any) -> list[Mapping[str, Any]] | None:
    """The sources of config.json's ``mixture`` entry, or None when it is not a readable one."""
    if not isinstance(mixture, Mapping) or not isinstance(mixture.get("sources"), list):
        return None
    sources = mixture["sources"][:MAX_SOURCES]
    return sources if sources and all(isinstance(s, Mapping) for s in sources) else None


def _share_cell(share: Any, index: int) -> Cell:
    value = number(share)
    if value is None:
        return Cell("n/a", -float("inf"))
    return Cell(svg.meter(value, fill=svg.colour(index), title=f"share {pct(value, 1)}") + " " + pct(value, 1),
                value)


def _source_table(sources: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Markup:
    rows = []
    for i, (source, name) in enumerate(zip(sources, names)):
        rows.append([Cell(name), Cell(str(source.get("path", "")), mono=True), describe_amount(source),
                     describe_subset(source.get("subset")), num_cell(source.get("available")),
                     num_cell(source.get("drawn")), _share_cell(source.get("share"), i),
                     num_cell(source.get("passes"), lambda v: fixed(v, 2)), num_cell(source.get("shards"))])
    return table(["source", "path", "amount", "subset", "available", "drawn per epoch", "share", "passes",
                  "shards"], rows, scroll=len(rows) > 12)


def _class_table(sources: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Markup:
    """Selected samples per class and source, when the composition lists them."""
    counts = [s.get("class_counts") if isinstance(s.get("class_counts"), Mapping) else {} for s in sources]
    classes: list[str] = []
    for per_class in counts:
        classes += [str(c) for c in per_class if str(c) not in classes][:MAX_CLASS_ROWS - len(classes)]
    if not classes:
        return Markup("")
    rows = []
    for name in classes:
        values = [number(per_class.get(name)) for per_class in counts]
        rows.append([Cell(name), *[num_cell(v) for v in values], num_cell(sum(v or 0.0 for v in values))])
    body = table(["class", *names, "total"], rows, scroll=len(rows) > 15)
    return tag("details", tag("summary", f"Selected samples per class ({len(classes)} classes)") + body)


def _per_epoch(rows: Sequence[Mapping[str, Any]], sources: Sequence[Mapping[str, Any]]) -> Markup:
    recorded = [row for row in rows if isinstance(row.get("mixture_drawn"), list)]
    if not recorded:
        return Markup("")
    drawn = [[number(v) for v in row["mixture_drawn"][:MAX_SOURCES]] for row in recorded]
    n = max(len(values) for values in drawn)
    drawn = [values + [None] * (n - len(values)) for values in drawn]
    names = source_names(sources, n)
    epochs = [number(row.get("epoch")) or float(i + 1) for i, row in enumerate(recorded)]
    labels = [f"{epoch:.0f}" for epoch in epochs]
    body = [[num_cell(epoch), *[num_cell(v) for v in values], num_cell(sum(v or 0.0 for v in values))]
            for epoch, values in zip(epochs, drawn)]
    series = [(name, [values[i] for values in drawn][-MAX_EPOCH_COLUMNS:]) for i, name in enumerate(names)]
    chart = svg.columns(labels[-MAX_EPOCH_COLUMNS:], series, count, stacked=True, integer=True,
                        title="samples drawn per source and epoch", x_title="epoch", width=560, height=240)
    parts = [tag("div", figure(chart, "Samples each source filled, per epoch (metrics.jsonl's mixture_drawn).")
                 + table(["epoch", *names, "total"], body, scroll=len(body) > 12), class_="grid2")]
    planned = [number(s.get("drawn")) for s in sources] + [None] * (n - len(sources))
    if sources and None not in planned:
        other = [label for label, values in zip(labels, drawn) if values != planned]
        if other:
            parts.append(note(f"Epoch {', '.join(other[:10])}{'...' if len(other) > 10 else ''} drew other amounts "
                              "than config.json's mixture records per epoch.", "warn"))
    return tag("h4", "Samples drawn per epoch") + join(parts)


def mixture_part(mixture: Any, rows: Sequence[Mapping[str, Any]]) -> Markup:
    """The "Data mixture" subsection, or nothing when the run read one whole folder (neither entry present)."""
    has_rows = any("mixture_drawn" in row for row in rows)
    if mixture is None and not has_rows:
        return Markup("")
    sources = recorded_sources(mixture)
    parts = []
    if sources is None:
        if mixture is not None:
            parts.append(note("config.json's mixture entry is not a list of sources; left out.", "warn"))
        sources = []
    else:
        names = source_names(sources, len(sources))
        class_map = mixture.get("class_map") if isinstance(mixture.get("class_map"), str) else "n/a"
        meaning = CLASS_MAPS.get(class_map)
        parts.append(note(f"{len(sources)} source{'s' if len(sources) != 1 else ''}, "
                          f"{count(mixture.get('epoch_size'))} samples per epoch. Class map: {class_map}"
                          + (f" ({meaning})." if meaning else ".")))
        parts += [_source_table(sources, names), _class_table(sources, names)]
    parts.append(_per_epoch(rows, sources))
    return subsection("Data mixture", join(parts))
