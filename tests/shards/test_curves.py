"""Training curves: PNG and SVG for any number of epochs, readable ticks, the best epoch marked, same bytes twice."""

import io
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from PIL import Image

from shards.report.curves import curves_bytes, curves_figure, find_best_epoch
from train.run.plot import plot_curves

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAMESPACE_URIS = {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}


def history(epochs: int, *, best: int | None = None) -> list[dict]:
    """Rows shaped like metrics.jsonl; val top-1 peaks at ``best`` (default: the last epoch)."""
    best = epochs if best is None else best
    rows = []
    for epoch in range(1, epochs + 1):
        rows.append({"epoch": epoch, "lr": 3e-4 * 0.5 * (1 + math.cos(math.pi * epoch / max(epochs, 1))),
                     "train_loss": 2.0 / epoch, "val_loss": 2.2 / epoch + 0.1, "train_top1": 1 - 0.5 / epoch,
                     "val_top1": 0.8 - 0.01 * abs(epoch - best), "val_top5": 0.95 - 0.005 * abs(epoch - best),
                     "samples_per_s": 12000.0 + epoch, "data_wait_share": 0.02})
    return rows


def svg_text(data: bytes) -> str:
    return " ".join(text for element in ET.fromstring(data).iter() for text in [element.text] if text)


@pytest.mark.parametrize("epochs", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(40, marks=pytest.mark.slow)])
def test_png_and_svg_are_produced_for_any_number_of_epochs(epochs):
    assert curves_bytes(history(epochs), "png").startswith(PNG_MAGIC)
    svg = curves_bytes(history(epochs), "svg")
    assert ET.fromstring(svg).tag == "{http://www.w3.org/2000/svg}svg"
    with Image.open(io.BytesIO(curves_bytes(history(epochs), "png"))) as image:
        assert image.width >= 600 and image.height >= 300


def test_zero_epochs_says_so():
    assert "no epochs yet" in svg_text(curves_bytes([], "svg"))


@pytest.mark.parametrize("epochs", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(40, marks=pytest.mark.slow)])
def test_svg_references_nothing_outside_itself(epochs):
    svg = curves_bytes(history(epochs), "svg").decode("utf-8")
    assert set(re.findall(r"https?://[^\s\"'<>)]+", svg)) <= NAMESPACE_URIS
    assert "<!DOCTYPE" not in svg and "<image" not in svg


def test_rows_without_any_known_metric_say_so():
    assert "no metrics to plot" in svg_text(curves_bytes([{"epoch": 1}, {"epoch": 2, "val_f1": 0.5}], "svg"))


@pytest.mark.slow  # over half a second in the quick loop
def test_a_regression_run_gets_an_r2_panel_and_its_best_is_the_lowest_val_mse():
    rows = [{"epoch": e, "train_loss": 1.0 / e, "val_loss": 1.0 / e, "val_mse": mse, "val_r2": r2}
            for e, (mse, r2) in enumerate([(9.0, 0.1), (4.0, 0.6), (5.0, 0.5), (4.0, 0.6)], 1)]
    assert find_best_epoch(rows) == 2  # best.pt: the first lowest val_mse
    text = svg_text(curves_bytes(rows, "svg"))
    assert "val R²" in text and "best val R² 0.600 at epoch 2" in text and "Accuracy" not in text


@pytest.mark.slow
def test_svg_keeps_text_as_text():
    assert "Training curves" in svg_text(curves_bytes(history(3), "svg"))


def figure_text(figure) -> str:
    """Every text artist of a figure, without rendering it (the SVG tests show text reaches the file as text)."""
    from matplotlib.text import Text

    return " ".join(artist.get_text() for artist in figure.findobj(Text))


@pytest.mark.slow  # over half a second in the quick loop
def test_best_epoch_is_the_first_highest_val_top1_and_is_marked():
    rows = history(40, best=23)
    rows[30]["val_top1"] = rows[22]["val_top1"]  # a later tie: best.pt still holds epoch 23
    assert find_best_epoch(rows) == 23
    text = figure_text(curves_figure(rows))
    assert "best: epoch 23" in text and "at epoch 23" in text


def test_an_explicit_best_epoch_wins():
    assert "best: epoch 7" in figure_text(curves_figure(history(10, best=3), best_epoch=7))


@pytest.mark.slow  # renders twice with matplotlib
@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_same_history_gives_the_same_bytes(fmt):
    assert curves_bytes(history(40), fmt) == curves_bytes(history(40), fmt)


def test_unknown_format_is_an_input_error():
    with pytest.raises(ValueError, match="pdf"):
        curves_bytes(history(2), "pdf")


@pytest.mark.slow  # over half a second in the quick loop
def test_forty_epochs_get_a_handful_of_integer_epoch_ticks():
    figure = curves_figure(history(40))
    figure.canvas.draw()
    assert len(figure.axes) >= 4
    for ax in figure.axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert 2 <= len(ticks) <= 12
        assert all(float(t).is_integer() for t in ticks)


def test_accuracy_and_share_axes_read_as_percentages():
    figure = curves_figure(history(5))
    accuracy = next(ax for ax in figure.axes if ax.get_title(loc="left") == "Accuracy")
    # The labels the axis's formatter gives its ticks, as a draw would (without rendering the figure).
    labels = [label for label in accuracy.yaxis.get_major_formatter().format_ticks(accuracy.get_yticks()) if label]
    assert labels and all(label.endswith("%") for label in labels)


def test_missing_keys_drop_their_panel_and_none_values_are_gaps():
    rows = [{"epoch": e, "train_loss": 1.0 / e, "val_loss": None if e == 2 else 1.1 / e, "val_mse": 0.5,
             "lr": 0.1} for e in range(1, 5)]
    figure = curves_figure(rows)
    assert [ax.get_title(loc="left") for ax in figure.axes] == ["Loss", "Learning rate"]
    assert curves_bytes(rows, "png").startswith(PNG_MAGIC)


@pytest.mark.slow  # over half a second in the quick loop
def test_plot_curves_writes_a_png_atomically(tmp_path: Path):
    path = plot_curves(history(40), tmp_path / "curves.png")
    assert path == tmp_path / "curves.png"
    with Image.open(path) as image:
        assert image.format == "PNG"
        image.load()
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]


@pytest.mark.slow  # starts a Python that imports torch
def test_importing_the_training_loop_does_not_import_matplotlib():
    code = "import sys, train.run.loop, train.run.plot; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "False"
