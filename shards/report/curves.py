"""Training curves from ``metrics.jsonl`` rows: loss, accuracy, learning rate, throughput and data wait per epoch.

A run is judged from this figure, so it must not mislead: epochs get integer ticks (a handful, however long the
run), accuracies and shares read as percentages, legends sit outside the data, and the epoch ``best.pt`` came from
is marked. A panel whose keys a run never wrote (a regression run has no top-1) is left out instead of drawn empty.
Same rows, same bytes: the SVG ids are salted with a constant and no date is written, so a redrawn figure diffs
clean. Matplotlib is imported inside the functions and used through ``Figure`` and the Agg canvas, not pyplot: a
training process never opens a window or shares global figure state, and importing the training loop stays fast.
"""

from __future__ import annotations

import enum
import io
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from shards.errors import InputError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FORMATS = ("png", "svg")
MAX_EPOCH_TICKS = 10
# Enough points to see each one; beyond this, markers only thicken the line.
MARKERS_UP_TO = 30
PANEL_SIZE_IN = (6.0, 3.4)
DPI = 110
TITLE = "Training curves"
BEST_COLOUR = "#555555"

_STYLE = {
    "font.family": "DejaVu Sans",  # ships with matplotlib: the same glyphs and metrics on every machine
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e0e0e0",
    "grid.linewidth": 0.8,
    "legend.frameon": False,
    "legend.fontsize": 8.5,
    "figure.facecolor": "white",
    "savefig.facecolor": "white",
}
# Text stays text (searchable, small); ids come from a fixed salt instead of a random one.
_SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "shardcache-curves"}
# No date, no creator URL, no RDF block: equal input gives equal bytes, and the SVG references nothing outside.
_METADATA = {
    "png": {"Software": None},
    "svg": {"Date": None, "Creator": None, "Format": None, "Type": None},
}
_DOCTYPE = re.compile(rb"<!DOCTYPE[^>]*>\s*")


class YAxis(enum.Enum):
    """How a panel's values read: what the tick labels must make obvious."""

    PLAIN = "plain"
    PERCENT = "percent"  # fractions in 0..1 shown as 0..100 %
    SHARE = "share"  # a percentage whose size matters (time spent waiting): the axis starts at zero
    RATE = "rate"  # learning rates: 3e-4 reads better than 0.0003
    COUNT = "count"  # samples/s: thousands separators, axis from zero


@dataclass(frozen=True)
class Series:
    key: str
    label: str
    colour: str
    linestyle: str = "-"


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]
    axis: YAxis
    twin: tuple[Series, ...] = ()  # drawn on a right-hand axis with its own scale
    twin_axis: YAxis = YAxis.SHARE


PANELS = (
    Panel("Loss", (Series("train_loss", "train", "#1f77b4"), Series("val_loss", "val", "#ff7f0e")), YAxis.PLAIN),
    Panel("Accuracy", (Series("train_top1", "train top-1", "#1f77b4"), Series("val_top1", "val top-1", "#ff7f0e"),
                       Series("val_top5", "val top-5", "#ff7f0e", "--")), YAxis.PERCENT),
    Panel("R²", (Series("val_r2", "val R²", "#ff7f0e"),), YAxis.PLAIN),  # regression runs
    Panel("Learning rate", (Series("lr", "lr", "#9467bd"),), YAxis.RATE),
    Panel("Throughput", (Series("samples_per_s", "samples/s", "#2ca02c"),), YAxis.COUNT,
          twin=(Series("data_wait_share", "data wait (right)", "#d62728", "--"),)),
)


def _epoch(row: Mapping[str, Any], index: int) -> int:
    epoch = row.get("epoch")
    return index + 1 if epoch is None else int(epoch)


def _points(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Epochs and values where ``key`` holds a finite number; a missing, None or NaN value is a gap, not a zero."""
    epochs, values = [], []
    for index, row in enumerate(history):
        value = row.get(key)
        if value is None or not math.isfinite(float(value)):
            continue
        epochs.append(_epoch(row, index))
        values.append(float(value))
    return epochs, values


def find_best_epoch(history: Sequence[Mapping[str, Any]]) -> int | None:
    """The first epoch with the highest ``val_top1`` (a regression run: the lowest ``val_mse``): the training loop
    copies ``best.pt`` only on a strict gain, so a later tie is not the checkpoint on disk."""
    epochs, values = _points(history, "val_top1")
    if values:
        return epochs[values.index(max(values))]
    epochs, values = _points(history, "val_mse")
    return epochs[values.index(min(values))] if values else None


def _title(history: Sequence[Mapping[str, Any]], best: int | None) -> str:
    count = len(history)
    text = f"{TITLE}: {count} epoch{'s' if count != 1 else ''}"
    if best is None:
        return text
    for key, name, form in (("val_top1", "val top-1", "{:.1%}"), ("val_r2", "val R²", "{:.3f}")):
        epochs, values = _points(history, key)
        if best in epochs:
            return f"{text}, best {name} {form.format(values[epochs.index(best)])} at epoch {best}"
    return f"{text}, best at epoch {best}"


def _rate_label(value: float, _pos: Any = None) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e-2:
        return f"{value:g}"
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def _count_label(value: float, _pos: Any = None) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:g}"


def _format_y(ax: Axes, axis: YAxis, values: Sequence[float]) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator, PercentFormatter

    ax.yaxis.set_major_locator(MaxNLocator(nbins=6))
    if axis in (YAxis.PERCENT, YAxis.SHARE):
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
        if values:
            # A little headroom, but never a "120 %" tick.
            low, high = ax.get_ylim()
            ax.set_ylim(0 if axis is YAxis.SHARE else max(low, -0.02), min(max(high, 0.01), 1.02))
    elif axis is YAxis.RATE:
        ax.yaxis.set_major_formatter(FuncFormatter(_rate_label))
    elif axis is YAxis.COUNT:
        ax.yaxis.set_major_formatter(FuncFormatter(_count_label))
        if values:
            ax.set_ylim(bottom=0)
    else:
        ax.ticklabel_format(axis="y", useOffset=False)


def _plot(ax: Axes, history: Sequence[Mapping[str, Any]], series: Sequence[Series]) -> list[float]:
    """Draw each series that has data; returns all values drawn (for the axis limits)."""
    drawn: list[float] = []
    all_epochs = [_epoch(row, index) for index, row in enumerate(history)]
    for one in series:
        epochs, values = _points(history, one.key)
        if not values:
            continue
        # NaN where an epoch has no value, so the line breaks there instead of bridging the gap.
        by_epoch = dict(zip(epochs, values))
        line = [by_epoch.get(epoch, math.nan) for epoch in all_epochs]
        marker = "o" if len(all_epochs) <= MARKERS_UP_TO else None
        ax.plot(all_epochs, line, linestyle=one.linestyle, color=one.colour, label=one.label, marker=marker,
                markersize=3.5, linewidth=1.6)
        drawn.extend(values)
    return drawn


def _draw_panel(ax: Axes, panel: Panel, history: Sequence[Mapping[str, Any]], xlim: tuple[float, float],
                best: int | None) -> None:
    from matplotlib.ticker import MaxNLocator

    _format_y(ax, panel.axis, _plot(ax, history, panel.series))
    handles, labels = ax.get_legend_handles_labels()
    if panel.twin:
        twin = ax.twinx()
        twin.spines["right"].set_visible(True)
        twin.grid(False)
        _format_y(twin, panel.twin_axis, _plot(twin, history, panel.twin))
        more_handles, more_labels = twin.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.set_title(panel.title)
    ax.set_xlim(*xlim)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=MAX_EPOCH_TICKS, integer=True, min_n_ticks=1))
    ax.set_xlabel("epoch")
    if best is not None:
        ax.axvline(best, color=BEST_COLOUR, linestyle=":", linewidth=1.2, zorder=1)
    if handles:
        # Above the axes, right-aligned: the title keeps the left, the data keeps the inside.
        ax.legend(handles, labels, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncols=len(handles),
                  borderaxespad=0.2, handlelength=1.8, columnspacing=1.2)


def _label_best(ax: Axes, best: int, xlim: tuple[float, float]) -> None:
    """Name the dotted line once, on the side of it that has room."""
    right_half = best > (xlim[0] + xlim[1]) / 2
    ax.annotate(f"best: epoch {best}", xy=(best, 0.04), xycoords=("data", "axes fraction"),
                xytext=(-4 if right_half else 4, 0), textcoords="offset points", ha="right" if right_half else "left",
                va="bottom", fontsize=8, color=BEST_COLOUR,
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})


def _x_limits(history: Sequence[Mapping[str, Any]]) -> tuple[float, float]:
    epochs = [_epoch(row, index) for index, row in enumerate(history)]
    low, high = min(epochs), max(epochs)
    pad = max(0.5, 0.02 * (high - low))
    return low - pad, high + pad


def _note_figure(title: str, note: str) -> Figure:
    """A figure that says why there are no curves, so a reader is not left guessing at a blank image."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=PANEL_SIZE_IN, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    ax.set_axis_off()
    ax.text(0.5, 0.5, note, ha="center", va="center", fontsize=12, color="#777777",
            transform=ax.transAxes)
    figure.suptitle(title)
    return figure


def curves_figure(history: Sequence[Mapping[str, Any]], *, best_epoch: int | None = None) -> Figure:
    """The figure for ``history`` (``metrics.jsonl`` rows, oldest first). ``best_epoch`` defaults to the epoch with
    the highest ``val_top1``; pass it when the caller knows better (a resumed run, another selection metric)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.rc_context(_STYLE):
        if not history:
            return _note_figure(f"{TITLE}: 0 epochs", "no epochs yet")
        best = best_epoch if best_epoch is not None else find_best_epoch(history)
        panels = [panel for panel in PANELS
                  if any(_points(history, one.key)[1] for one in panel.series + panel.twin)]
        if not panels:
            return _note_figure(_title(history, best), "no metrics to plot in these rows")
        columns = min(2, len(panels))
        rows = math.ceil(len(panels) / columns)
        figure = Figure(figsize=(PANEL_SIZE_IN[0] * columns, PANEL_SIZE_IN[1] * rows + 0.4), dpi=DPI,
                        layout="constrained")
        FigureCanvasAgg(figure)
        axes = figure.subplots(rows, columns, squeeze=False).ravel()
        for unused in axes[len(panels):]:
            unused.remove()
        xlim = _x_limits(history)
        for ax, panel in zip(axes, panels):
            _draw_panel(ax, panel, history, xlim, best)
        if best is not None:
            labelled = next((ax for ax, panel in zip(axes, panels) if panel.title in ("Accuracy", "R²")), axes[0])
            _label_best(labelled, best, xlim)
        figure.suptitle(_title(history, best), fontsize=11)
        figure.get_layout_engine().set(h_pad=0.08, w_pad=0.08, hspace=0.06, wspace=0.04)
    return figure


def render(figure: Figure, fmt: str) -> bytes:
    """``figure`` as PNG or SVG bytes, reproducibly (no timestamps, fixed SVG ids, no DOCTYPE URL to fetch)."""
    import matplotlib

    if fmt not in FORMATS:
        raise InputError(f"figure format {fmt!r} is not supported; choose one of {', '.join(FORMATS)}")
    buffer = io.BytesIO()
    with matplotlib.rc_context({**_STYLE, **_SVG_RC}):
        figure.savefig(buffer, format=fmt, dpi=DPI, metadata=_METADATA[fmt])
    data = buffer.getvalue()
    return _DOCTYPE.sub(b"", data, count=1) if fmt == "svg" else data


def curves_bytes(history: Sequence[Mapping[str, Any]], fmt: str = "svg", *, best_epoch: int | None = None) -> bytes:
    """The curves of ``history`` as ``fmt`` bytes: what a report or a web page embeds."""
    return render(curves_figure(history, best_epoch=best_epoch), fmt)
