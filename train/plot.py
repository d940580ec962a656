"""``curves.png``: loss and accuracy per epoch, drawn with PIL so plotting adds no dependency."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from PIL import Image, ImageDraw, ImageFont

from shards.atomic import atomic_output

PANEL_W, PANEL_H, MARGIN = 420, 300, 48
COLOURS = {"train_loss": (31, 119, 180), "val_loss": (255, 127, 14), "train_top1": (44, 160, 44),
           "val_top1": (214, 39, 40), "val_top5": (148, 103, 189)}


def _nice_range(values: Sequence[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if high - low < 1e-12:
        low, high = low - 0.5, high + 0.5
    pad = (high - low) * 0.05
    return low - pad, high + pad


def _draw_panel(draw: ImageDraw.ImageDraw, origin: tuple[int, int], title: str,
                series: Mapping[str, Sequence[tuple[int, float]]], y_range: tuple[float, float] | None) -> None:
    """Axes, ticks, one polyline with dots per series, and a legend, inside a PANEL_W x PANEL_H box."""
    font = ImageFont.load_default()
    x0, y0 = origin[0] + MARGIN, origin[1] + 24
    x1, y1 = origin[0] + PANEL_W - 12, origin[1] + PANEL_H - 30
    draw.text((origin[0] + MARGIN, origin[1] + 6), title, fill="black", font=font)
    draw.rectangle([x0, y0, x1, y1], outline="black")
    points = [p for values in series.values() for p in values]
    if not points:
        draw.text((x0 + 10, y0 + 10), "no data yet", fill="gray", font=font)
        return
    epochs = [p[0] for p in points]
    e_low, e_high = min(epochs), max(max(epochs), min(epochs) + 1)
    v_low, v_high = y_range or _nice_range([p[1] for p in points])

    def to_xy(epoch: float, value: float) -> tuple[float, float]:
        x = x0 + (epoch - e_low) / (e_high - e_low) * (x1 - x0)
        y = y1 - (value - v_low) / (v_high - v_low) * (y1 - y0)
        return x, y

    for i in range(5):
        value = v_low + (v_high - v_low) * i / 4
        _, y = to_xy(e_low, value)
        draw.line([x0 - 4, y, x0, y], fill="black")
        draw.text((origin[0] + 2, y - 6), f"{value:.3g}", fill="black", font=font)
    for epoch in sorted(set(epochs)):
        x, _ = to_xy(epoch, v_low)
        draw.line([x, y1, x, y1 + 4], fill="black")
        draw.text((x - 4, y1 + 6), str(epoch), fill="black", font=font)
    draw.text(((x0 + x1) // 2 - 12, y1 + 16), "epoch", fill="black", font=font)
    for row, (name, values) in enumerate(series.items()):
        colour = COLOURS.get(name, (0, 0, 0))
        xy = [to_xy(e, v) for e, v in values]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for x, y in xy:
            draw.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
        draw.line([x1 - 110, y0 + 12 + row * 14, x1 - 92, y0 + 12 + row * 14], fill=colour, width=2)
        draw.text((x1 - 88, y0 + 6 + row * 14), name, fill="black", font=font)


def _series(history: Sequence[Mapping[str, float]], names: Sequence[str]) -> dict[str, list[tuple[int, float]]]:
    out = {}
    for name in names:
        values = [(int(row["epoch"]), float(row[name])) for row in history if row.get(name) is not None]
        if values:
            out[name] = values
    return out


def plot_curves(history: Sequence[Mapping[str, float]], path: str | os.PathLike) -> Path:
    """Two panels side by side: losses, and accuracies on a 0..1 axis. Written atomically."""
    image = Image.new("RGB", (2 * PANEL_W, PANEL_H), "white")
    draw = ImageDraw.Draw(image)
    _draw_panel(draw, (0, 0), "loss", _series(history, ["train_loss", "val_loss"]), None)
    _draw_panel(draw, (PANEL_W, 0), "accuracy", _series(history, ["train_top1", "val_top1", "val_top5"]),
                (0.0, 1.0))
    path = Path(path)
    with atomic_output(path) as tmp:
        image.save(tmp, format="PNG")
    return path
