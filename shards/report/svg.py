"""Hand-drawn inline SVG charts: bars, stacked columns, a share bar, a table cell's meter and a heat map.

Drawn by hand rather than with matplotlib because these must stay cheap enough to redraw every epoch, scale with
the page, and carry untrusted class names safely (escaped text, a ``<title>`` tooltip with the full name, a short
label on the axis). Layout rules: labels never overlap (long ones are cut with an ellipsis, crowded axis labels are
thinned), legends sit outside the data, and numbers are printed where a reader needs the exact value.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from shards.report.html import Markup, join, tag

CHAR_W = 6.8  # average width of a 12 px sans-serif character: enough to keep estimated labels apart
FONT = 12
TEXT = "#1d2733"
MUTED = "#5f6b7a"
GRID = "#e6e9ee"
PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d", "#ff9da6",
           "#bab0ac")
Formatter = Callable[[float], str]


def colour(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def short(text: str, max_chars: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= max_chars else text[:max(1, max_chars - 1)] + "\u2026"


def _svg(width: float, height: float, content: Markup, label: str) -> Markup:
    # No xmlns: inline in HTML5 the parser puts <svg> in the SVG namespace itself.
    return tag("svg", content, width=f"{width:.0f}", height=f"{height:.0f}",
               viewBox=f"0 0 {width:.0f} {height:.0f}", role="img", aria_label=label,
               font_family="system-ui, -apple-system, Segoe UI, Roboto, Arial, sans-serif", font_size=str(FONT))


def _text(x: float, y: float, content: object, *, anchor: str = "start", fill: str = TEXT, size: int | None = None,
          weight: str | None = None, transform: str | None = None) -> Markup:
    return tag("text", content, x=f"{x:.1f}", y=f"{y:.1f}", text_anchor=anchor, fill=fill,
               font_size=None if size is None else str(size), font_weight=weight, transform=transform)


def _rect(x: float, y: float, w: float, h: float, fill: str, tooltip: str | None = None, **extra: object) -> Markup:
    return tag("rect", tag("title", tooltip) if tooltip else "", x=f"{x:.1f}", y=f"{y:.1f}",
               width=f"{max(w, 0):.1f}", height=f"{max(h, 0):.1f}", fill=fill, **extra)


def _line(x1: float, y1: float, x2: float, y2: float, stroke: str = GRID, **extra: object) -> Markup:
    return tag("line", x1=f"{x1:.1f}", y1=f"{y1:.1f}", x2=f"{x2:.1f}", y2=f"{y2:.1f}", stroke=stroke, **extra)


def nice_ticks(top: float, target: int = 5, *, integer: bool = False) -> list[float]:
    """0 and round steps up to at least ``top`` (1, 2, 2.5 or 5 times a power of ten; whole steps for counts)."""
    if not top > 0:
        return [0.0, 1.0]
    raw = max(top / target, 1.0) if integer else top / target
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in ((1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)) if m * magnitude >= raw)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def legend(entries: Sequence[tuple[str, str]], x: float, y: float, width: float) -> tuple[Markup, float]:
    """Swatches with names, wrapped into rows within ``width``; returns the markup and the height used."""
    parts, cx, cy = [], x, y
    for name, fill in entries:
        label = short(name, 28)
        need = 18 + len(label) * CHAR_W + 14
        if cx > x and cx + need > x + width:
            cx, cy = x, cy + 18
        parts.append(_rect(cx, cy, 11, 11, fill, name, rx="2"))
        parts.append(_text(cx + 16, cy + 10, label, fill=MUTED))
        cx += need
    return join(parts), (cy - y) + 18 if entries else 0.0


def hbars(labels: Sequence[str], series: Sequence[tuple[str, Sequence[float | None]]], fmt: Formatter, *,
          width: int = 560, label_chars: int = 24, title: str = "bar chart") -> Markup:
    """Horizontal bars, one group per label and one bar per series, the value printed at each bar's end."""
    label_w = min(label_chars, max([len(str(label)) for label in labels] + [4])) * CHAR_W + 12
    value_w = max([len(fmt(v)) for _, values in series for v in values if v is not None] + [3]) * CHAR_W + 10
    plot_x, plot_w = label_w, max(80.0, width - label_w - value_w)
    top = max([v for _, values in series for v in values if v is not None] + [0.0])
    bar_h, gap = (14, 8) if len(series) > 1 else (16, 6)
    head, lg_h = (legend([(name, colour(i)) for i, (name, _) in enumerate(series)], plot_x, 4, plot_w)
                  if len(series) > 1 else (Markup(""), 0.0))
    y0 = 8 + lg_h
    group_h = bar_h * len(series) + gap
    parts = [head]
    for row, label in enumerate(labels):
        gy = y0 + row * group_h
        parts.append(_text(label_w - 8, gy + group_h / 2 + 1, short(label, label_chars), anchor="end"))
        for s, (name, values) in enumerate(series):
            value = values[row] if row < len(values) else None
            by = gy + s * bar_h
            w = 0.0 if value is None or top <= 0 else plot_w * value / top
            tip = f"{label} \u00b7 {name}: {'n/a' if value is None else fmt(value)}"
            parts.append(_rect(plot_x, by + 1, w, bar_h - 2, colour(s), tip, rx="2"))
            parts.append(_text(plot_x + w + 5, by + bar_h - 3.5, "n/a" if value is None else fmt(value),
                               fill=MUTED, size=11))
    height = y0 + len(labels) * group_h + 4
    parts.insert(0, _line(plot_x, y0 - 2, plot_x, height - 4, stroke="#9aa5b1"))
    return _svg(width, height, join(parts), title)


def columns(labels: Sequence[str], series: Sequence[tuple[str, Sequence[float | None]]], fmt: Formatter, *,
            stacked: bool = False, width: int = 560, height: int = 240, threshold: tuple[float, str] | None = None,
            colours: Sequence[str] | None = None, title: str = "column chart", x_title: str | None = None,
            integer: bool = False, axis_fmt: Formatter | None = None) -> Markup:
    """Vertical columns per label (an epoch, a rank, a histogram bin): grouped or stacked series, a value axis
    with round ticks (whole ones when ``integer``), an optional dashed threshold, thinned x labels, and the legend
    above the plot. ``axis_fmt`` writes the tick labels (default ``fmt``, which also writes the tooltips)."""
    fills = list(colours) if colours else [colour(i) for i in range(len(series))]
    totals = [sum((values[i] or 0.0) for _, values in series if i < len(values)) if stacked else
              max([(values[i] or 0.0) for _, values in series if i < len(values)] + [0.0]) for i in range(len(labels))]
    ticks = nice_ticks(max(totals + [threshold[0] if threshold else 0.0]), integer=integer)
    axis_fmt = axis_fmt or fmt
    axis_w = max(len(axis_fmt(t)) for t in ticks) * CHAR_W + 12
    plot_x, plot_w = axis_w, width - axis_w - 8
    lg, lg_h = (legend([(name, fills[i]) for i, (name, _) in enumerate(series)], plot_x, 4, plot_w)
                if len(series) > 1 else (Markup(""), 0.0))
    plot_y = 10 + lg_h
    plot_h = height - plot_y - (34 if x_title else 22)
    scale = plot_h / ticks[-1]
    parts = [lg]
    for t in ticks:
        y = plot_y + plot_h - t * scale
        parts.append(_line(plot_x, y, plot_x + plot_w, y))
        parts.append(_text(plot_x - 6, y + 4, axis_fmt(t), anchor="end", fill=MUTED, size=11))
    slot = plot_w / max(1, len(labels))
    bar_w = max(1.0, slot * (0.9 if len(labels) > 40 else 0.72))
    shown = _shown_labels(labels, slot)
    for i, label in enumerate(labels):
        x = plot_x + i * slot + (slot - bar_w) / 2
        base = plot_y + plot_h
        for s, (name, values) in enumerate(series):
            value = values[i] if i < len(values) else None
            if value is None:
                continue
            tip = f"{label} \u00b7 {name}: {fmt(value)}" if len(series) > 1 else f"{label}: {fmt(value)}"
            if stacked:
                h = value * scale
                parts.append(_rect(x, base - h, bar_w, h, fills[s], tip))
                base -= h
            else:
                w = bar_w / len(series)
                parts.append(_rect(x + s * w, base - value * scale, w, value * scale, fills[s], tip))
        if i in shown:
            parts.append(_text(plot_x + (i + 0.5) * slot, plot_y + plot_h + 15, label, anchor="middle",
                               fill=MUTED, size=11))
    parts.append(_line(plot_x, plot_y + plot_h, plot_x + plot_w, plot_y + plot_h, stroke="#9aa5b1"))
    if threshold:
        y = plot_y + plot_h - threshold[0] * scale
        parts.append(_line(plot_x, y, plot_x + plot_w, y, stroke="#d2553f", stroke_dasharray="5 4"))
        parts.append(_text(plot_x + plot_w - 4, y - 4, threshold[1], anchor="end", fill="#b3412d", size=11))
    if x_title:
        parts.append(_text(plot_x + plot_w / 2, height - 4, x_title, anchor="middle", fill=MUTED, size=11))
    return _svg(width, height, join(parts), title)


def _shown_labels(labels: Sequence[str], slot: float) -> set[int]:
    """Which x labels fit without overlapping: every k-th, with k a round step (1, 2, 5, 10, 20, 50...);
    integer labels such as epochs are picked by value (5, 10, 15), others by position."""
    need = (max([len(str(label)) for label in labels] + [1]) * CHAR_W + 8) / slot
    every = next(step for step in _ROUND_STEPS if step >= need)
    if all(str(label).isdigit() for label in labels):
        picked = {i for i, label in enumerate(labels) if int(label) % every == 0}
        return picked or {0}
    return set(range(0, len(labels), every))


_ROUND_STEPS = tuple(m * 10 ** e for e in range(9) for m in (1, 2, 5))


def share_bar(parts: Sequence[tuple[str, float, str]], fmt: Formatter, *, width: int = 560,
              title: str = "shares") -> Markup:
    """One 100% bar split into named parts, with a legend of names and shares below (no label inside a sliver)."""
    total = sum(value for _, value, _ in parts if value > 0)
    out, x = [], 0.0
    for name, value, fill in parts:
        if value <= 0 or total <= 0:
            continue
        w = (width - 2) * value / total
        out.append(_rect(1 + x, 1, w, 26, fill, f"{name}: {fmt(value / total)}"))
        if w > len(fmt(value / total)) * CHAR_W + 8:
            out.append(_text(1 + x + w / 2, 18.5, fmt(value / total), anchor="middle", fill="#fff", size=11,
                             weight="600"))
        x += w
    entries = [(f"{name} {fmt(value / total)}" if total > 0 else name, fill) for name, value, fill in parts]
    lg, lg_h = legend(entries, 1, 36, width - 2)
    return _svg(width, 40 + lg_h, join(out) + lg, title)


def meter(share: float, *, width: int = 90, fill: str = PALETTE[0], title: str = "share") -> Markup:
    """A small bar for a table cell: ``share`` (0..1) of a grey track filled."""
    share = min(1.0, max(0.0, share))
    return _svg(width, 10, _rect(0, 1, width, 8, GRID, rx="2") + _rect(0, 1, width * share, 8, fill, rx="2"), title)


BLUES = ((247, 251, 255), (198, 219, 239), (107, 174, 214), (33, 113, 181), (8, 48, 107))


def shade(share: float) -> str:
    share = min(1.0, max(0.0, share)) * (len(BLUES) - 1)
    low = min(int(share), len(BLUES) - 2)
    frac = share - low
    rgb = [round(a + (b - a) * frac) for a, b in zip(BLUES[low], BLUES[low + 1])]
    return "#" + "".join(f"{channel:02x}" for channel in rgb)


def heatmap(matrix: Sequence[Sequence[float]], labels: Sequence[str], *, max_size: int = 620,
            title: str = "confusion matrix") -> Markup:
    """A confusion matrix: rows are true classes, columns predictions; colour is the share of the row (so rare
    classes read as clearly as common ones), the count is printed in each cell when the cells are big enough."""
    n = len(matrix)
    label_chars = 18
    label_w = min(label_chars, max([len(str(label)) for label in labels] + [3])) * CHAR_W + 10
    cell = max(8.0, min(44.0, (max_size - label_w) / max(n, 1)))
    top = label_w * 0.72 + 26  # column labels at -45 degrees need about sin(45) of their length
    left = label_w + 20
    parts = [_text(left + n * cell / 2, 13, "predicted class", anchor="middle", fill=MUTED, size=11),
             _text(12, top + n * cell / 2, "true class", anchor="middle", fill=MUTED, size=11,
                   transform=f"rotate(-90 12 {top + n * cell / 2:.1f})")]
    show_counts = cell >= 20
    for i, row in enumerate(matrix):
        total = sum(row) or 1
        parts.append(_text(left - 6, top + i * cell + cell / 2 + 4, short(labels[i], label_chars), anchor="end",
                           size=11 if cell >= 14 else 9))
        for j, value in enumerate(row):
            share = value / total
            tip = f"true {labels[i]}, predicted {labels[j]}: {value:,.0f} ({100 * share:.1f}% of the row)"
            parts.append(_rect(left + j * cell, top + i * cell, cell - 1, cell - 1, shade(share), tip))
            if show_counts and value:
                parts.append(_text(left + j * cell + cell / 2 - 0.5, top + i * cell + cell / 2 + 4, f"{value:,.0f}",
                                   anchor="middle", size=11 if cell >= 30 else 9,
                                   fill="#fff" if share > 0.5 else TEXT))
    for j in range(n):
        x, y = left + j * cell + cell / 2 + 3, top - 6
        parts.append(_text(x, y, short(labels[j], label_chars), size=11 if cell >= 14 else 9,
                           transform=f"rotate(-45 {x:.1f} {y:.1f})"))
    scale_x = left + n * cell + 18
    for k in range(6):
        share = k / 5
        y = top + (5 - k) * 18
        parts.append(_rect(scale_x, y, 16, 16, shade(share), f"{100 * share:.0f}% of the row", stroke="#ccd3db"))
        parts.append(_text(scale_x + 22, y + 12, f"{100 * share:.0f}%", fill=MUTED, size=11))
    parts.append(_text(scale_x, top - 8, "share of row", fill=MUTED, size=11))
    width = scale_x + 80
    height = top + max(n * cell, 6 * 18) + 8
    return _svg(width, height, join(parts), title)
