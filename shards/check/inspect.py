"""``shards inspect``: what a folder holds, and what a model would actually be fed from it.

The summary (classes with counts, shards, sizes) comes from the manifest alone. ``batch_report`` runs one batch
through a DataLoader with the standard eval transform and reports shape, dtype, value range and label spread: the
first thing to look at when training misbehaves. ``save_grid`` writes augmented training images, each labelled
with its class name, to look at.

For a mixture (several sources, or one folder's subset: ``shards.select.mixture``), ``mixture_report`` says what
each epoch holds per source: samples available and drawn, share of the epoch, passes, and the classes drawn. Those
class counts are exact when a source is drawn a whole number of passes (every selected sample the same number of
times) or when every row's label is read (``exact_classes``, no image decoded); otherwise a fraction of a pass
picks shard runs from (seed, epoch), and the counts given are the expected ones, marked so.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from shards.atomic import atomic_output
from shards.errors import CorruptDataError, InputError
from shards.transport.manifest_io import load_manifest_at
from shards.manifest import DatasetManifest

if TYPE_CHECKING:  # the reader (torch) loads only when a mixture is inspected: the CLI stays light
    import numpy as np

    from shards.select.mixture import MixOptions, Mixture, SourceSpec


def _manifest(folder: str | os.PathLike, storage_options: Any = None, *, images: bool = False):
    """The folder's manifest, wherever it is (``shards.transport.manifest_io``; ``storage_options`` for ``s3://``)."""
    manifest = load_manifest_at(folder, storage_options=storage_options)[0]
    if images and not isinstance(manifest, DatasetManifest):
        raise InputError("needs an image dataset (dataset.json), not a feature folder", path=str(folder))
    return manifest


def summarize(folder: str | os.PathLike, *, storage_options: Any = None) -> dict[str, Any]:
    """Classes with per-split counts, shards and sizes, from the manifest."""
    manifest = _manifest(folder, storage_options)
    splits = {}
    for name, split in manifest.splits.items():
        sizes = split.shard_sizes
        splits[name] = {"samples": split.samples, "shards": len(split.shards),
                        "bytes": sum(s.bytes for s in split.shards),
                        "samples_per_shard": {"min": min(sizes, default=0), "max": max(sizes, default=0)}}
    classes = [{"index": i, "name": name,
                "counts": {split_name: split.class_counts[i] for split_name, split in manifest.splits.items()
                           if i < len(split.class_counts)}}
               for i, name in enumerate(manifest.classes)]
    summary = {"folder": str(folder), "kind": manifest.kind, "storage": manifest.storage, "classes": classes,
               "splits": splits, "bytes": sum(s["bytes"] for s in splits.values())}
    if isinstance(manifest, DatasetManifest):
        summary["skipped"] = len(manifest.source.skipped)
        summary["files_seen"] = manifest.source.files_seen
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """A short human-readable table of ``summarize``'s result."""
    lines = [f"{summary['folder']}: {summary['kind']} ({summary['storage']}), "
             f"{summary['bytes'] / 1e6:.1f} MB"]
    for name, split in summary["splits"].items():
        per = split["samples_per_shard"]
        lines.append(f"  {name}: {split['samples']} samples in {split['shards']} shards "
                     f"({per['min']}-{per['max']} per shard), {split['bytes'] / 1e6:.1f} MB")
    split_names = list(summary["splits"])
    width = max([len(c["name"]) for c in summary["classes"]] + [5])
    lines.append("  " + "class".ljust(width) + "".join(f"{s:>10}" for s in split_names))
    for cls in summary["classes"]:
        lines.append("  " + cls["name"].ljust(width) + "".join(f"{cls['counts'].get(s, 0):>10}" for s in split_names))
    if "skipped" in summary:
        lines.append(f"  skipped at pack time: {summary['skipped']} of {summary['files_seen']} files")
    return "\n".join(lines)


def _loader(folder: Path | str, split: str, transform: Callable, batch_size: int, *, shuffle: bool = False,
            seed: int = 0, storage_options: Any = None):
    """The reader training uses (so a problem there shows here), in-process: one batch is all we need."""
    from shards.loader.in_process import InProcess
    from shards.loader.loader import make_loader
    from shards.stream.options import Distributed, Remote, Sampling
    from shards.stream.reader import open_dataset

    dataset = open_dataset(folder, split, transform=transform, sampling=Sampling(shuffle=shuffle), seed=seed,
                           distributed=Distributed(rank=0, world_size=1),
                           remote=Remote(storage_options=storage_options))
    return make_loader(dataset, batch_size, mode=InProcess(), drop_last=False)


def _pick_split(manifest: DatasetManifest, split: str | None, prefer: str) -> str:
    if split is not None:
        manifest.split(split)
        return split
    if prefer in manifest.splits:
        return prefer
    if not manifest.splits:
        raise InputError("the manifest has no splits")
    return next(iter(manifest.splits))


def batch_report(folder: str | os.PathLike, *, split: str | None = None, batch_size: int = 32,
                 image_size: int = 224, storage_options: Any = None) -> dict[str, Any]:
    """One batch through the eval transform: shape, dtype, value range, label distribution."""
    from shards.image.transforms import build_transform

    manifest = _manifest(folder, storage_options, images=True)
    split = _pick_split(manifest, split, "val")
    loader = _loader(folder, split, build_transform("eval", size=image_size), batch_size,
                     storage_options=storage_options)
    images, labels = next(iter(loader))
    spread = Counter(manifest.classes[int(label)] for label in labels)
    return {"split": split, "shape": list(images.shape), "dtype": str(images.dtype).replace("torch.", ""),
            "min": round(float(images.min()), 4), "max": round(float(images.max()), 4),
            "mean": round(float(images.mean()), 4), "std": round(float(images.std()), 4),
            "labels_dtype": str(labels.dtype).replace("torch.", ""),
            "label_counts": {name: spread[name] for name in manifest.classes if spread[name]}}


GRID_PADDING = 2
GRID_COLUMNS = 8
LABEL_BACKGROUND, LABEL_TEXT = (255, 255, 255), (25, 25, 25)


def label_band_px(image_width: int) -> int:
    """Height of the label band under each image: text scales with the image so names stay legible at 224 px
    without swamping a 32 px thumbnail."""
    return _label_font_px(image_width) + 8


def _label_font_px(image_width: int) -> int:
    return max(10, min(18, image_width // 12))


def _fit(text: str, font: Any, width: int) -> str:
    """``text``, cut with an ellipsis to fit ``width`` pixels: a long class name must not spill into its neighbour."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def labelled_grid(images: Any, names: list[str], *, columns: int = GRID_COLUMNS, padding: int = GRID_PADDING):
    """A PIL image of ``images`` (uint8, N x H x W x 3) in rows of ``columns``, each with its name in a white band
    underneath: a grid is looked at to check that what the model sees matches its label."""
    from PIL import Image, ImageDraw, ImageFont

    count, height, width = images.shape[0], images.shape[1], images.shape[2]
    columns = max(1, min(columns, count))
    rows = -(-count // columns)
    band = label_band_px(width)
    tile_h = height + band
    canvas = Image.new("RGB", (columns * (width + padding) + padding, rows * (tile_h + padding) + padding), "black")
    draw = ImageDraw.Draw(canvas)
    try:
        font = ImageFont.load_default(size=_label_font_px(width))
    except TypeError:  # Pillow < 10.1 has only its small bitmap font, which still fits the band
        font = ImageFont.load_default()
    for index, name in enumerate(names):
        left = (index % columns) * (width + padding) + padding
        top = (index // columns) * (tile_h + padding) + padding
        canvas.paste(Image.fromarray(images[index]), (left, top))
        draw.rectangle([left, top + height, left + width - 1, top + tile_h - 1], fill=LABEL_BACKGROUND)
        text = _fit(name, font, width - 4)
        # Centred from the text's own box: bitmap fonts have no anchor support.
        x0, y0, x1, y1 = draw.textbbox((0, 0), text, font=font)
        draw.text((left + (width - (x1 - x0)) / 2 - x0, top + height + (band - (y1 - y0)) / 2 - y0), text,
                  fill=LABEL_TEXT, font=font)
    return canvas


def save_grid(folder: str | os.PathLike, out_path: str | os.PathLike, *, split: str | None = None,
              count: int = 16, image_size: int = 224, seed: int = 0, storage_options: Any = None) -> dict[str, Any]:
    """Save ``count`` training-augmented images (seeded) as one PNG grid, un-normalised so they look natural, each
    labelled with its class name."""
    import torch

    from shards.image.transforms import TransformSpec, build_transform

    manifest = _manifest(folder, storage_options, images=True)
    split = _pick_split(manifest, split, "train")
    spec = TransformSpec(preset="train", size=image_size)
    torch.manual_seed(seed)
    images, labels = next(iter(_loader(folder, split, build_transform(spec), count, shuffle=True, seed=seed,
                                    storage_options=storage_options)))
    mean = torch.tensor(spec.mean).view(1, 3, 1, 1)
    std = torch.tensor(spec.std).view(1, 3, 1, 1)
    # The same rounding torchvision's save_image uses, so the pixels match what it wrote before labels.
    pixels = (images * std + mean).clamp(0, 1).mul(255).add(0.5).clamp(0, 255).to(torch.uint8)
    names = [manifest.classes[int(label)] for label in labels]
    grid = labelled_grid(pixels.permute(0, 2, 3, 1).contiguous().numpy(), names)
    out_path = Path(out_path)
    with atomic_output(out_path) as tmp:
        grid.save(tmp, format="PNG")
    return {"grid": str(out_path), "images": len(names), "split": split, "labels": names}


# -- mixtures ------------------------------------------------------------------------------------------------------
MAX_CLASS_LINES = 40  # classes listed per epoch in the text table; the JSON has them all


def open_mixture(specs: Sequence[SourceSpec], split: str = "train", *, mix: MixOptions | None = None,
                 seed: int = 0, storage_options: Any = None):
    """The dataset training would stream from ``specs`` (one process, no transform: nothing is decoded)."""
    from shards.select.mixture import MixOptions
    from shards.stream.options import Distributed, Remote
    from shards.stream.reader import open_dataset

    return open_dataset(list(specs), split, seed=seed, distributed=Distributed(rank=0, world_size=1), cache="none",
                        mix=mix or MixOptions(), remote=Remote(storage_options=storage_options))


def row_labels(dataset: Any) -> np.ndarray:
    """Every row's label in the dataset's (combined) split, in row order, read from its shards without decoding a
    sample; a mixture's labels come mapped onto its combined classes."""
    import numpy as np

    from shards.order.plan import ShardSlice

    labels: list[int] = []
    for shard, samples in enumerate(dataset.split_info.shard_sizes):
        read = [int(sample.label) for sample in dataset.read_slice(ShardSlice(shard, 0, samples))]
        if len(read) != samples:
            raise CorruptDataError(f"holds {len(read)} samples, the manifest says {samples}",
                                   path=dataset.locations[shard])
        labels += read
    return np.asarray(labels, dtype=np.int64)


def drawn_class_counts(mixture: Mixture, epoch: int, labels: np.ndarray, num_classes: int) -> list[list[int]]:
    """Per source, the samples of each class that ``mixture.stream(epoch)`` draws, given every row's label
    (``labels[row]``, a combined class index). Sources occupy consecutive blocks of rows, in source order."""
    import numpy as np

    rows = mixture.stream(epoch)
    starts = np.asarray([int(runs[0][0]) for runs in mixture.runs], dtype=np.int64)
    source = np.searchsorted(starts, rows, side="right") - 1
    counts = np.zeros((len(mixture.runs), num_classes), dtype=np.int64)
    np.add.at(counts, (source, np.asarray(labels, dtype=np.int64)[rows]), 1)
    return counts.tolist()


def epoch_composition(mixture: Mixture, classes: Sequence[str], epoch: int,
                      labels: np.ndarray | None = None) -> list[dict[str, Any]]:
    """``mixture.composition(classes)`` plus the classes epoch ``epoch`` (as ``set_epoch`` takes it) draws from each
    source: ``drawn_class_counts`` and their ``drawn_class_counts_basis``, ``"exact"`` when counted from ``labels``
    or when the source is drawn whole passes, else ``"expected"`` (selected counts times passes)."""
    sources = mixture.composition(classes)
    counted = drawn_class_counts(mixture, epoch, labels, len(classes)) if labels is not None and classes else None
    for i, source in enumerate(sources):
        passes, rest = divmod(source["drawn"], source["available"])
        if counted is not None:
            drawn, basis = counted[i], "exact"
        elif not classes or not mixture.per_source_counts:  # a regression table: no classes to count
            continue
        elif rest == 0:
            drawn, basis = [n * passes for n in mixture.per_source_counts[i]], "exact"
        else:
            drawn, basis = [round(n * source["passes"], 2) for n in mixture.per_source_counts[i]], "expected"
        source["drawn_class_counts"] = {name: n for name, n in zip(classes, drawn) if n}
        source["drawn_class_counts_basis"] = basis
    return sources


def mixture_report(source: Any, split: str = "train", *, mix: MixOptions | None = None, seed: int = 0,
                   epochs: int = 1, classes: Sequence[str] | None = None, exact_classes: bool = False,
                   storage_options: Any = None) -> dict[str, Any]:
    """What each of ``epochs`` epochs of a mixture holds, per source.

    ``source`` is a dataset opened with ``open_dataset`` on several sources or a subset (its ``.mixture``), or
    the ``SourceSpec``s to open (with ``split``, ``mix`` and ``seed``, as training would). Class names are
    ``classes``, else the sources' combined by ``mix.class_map``. ``exact_classes`` reads every selected shard's
    labels (no decoding) so each epoch's class counts are exact for every source. Epochs are numbered from 1, as
    ``metrics.jsonl`` numbers them: epoch ``e`` is the dataset's ``set_epoch(e - 1)``."""
    from shards.select.mixture import MixOptions, SourceSpec

    mix = mix or MixOptions()
    if isinstance(epochs, bool) or int(epochs) < 1:
        raise InputError(f"epochs={epochs!r} must be an integer >= 1")
    if isinstance(source, SourceSpec):
        source = [source]
    dataset = open_mixture(source, split, mix=mix, seed=seed, storage_options=storage_options) \
        if isinstance(source, (list, tuple)) else source
    mixture = getattr(dataset, "mixture", None)
    if mixture is None:
        raise InputError("the dataset reads one whole folder: open it with several sources or a subset to report "
                         "a mixture")
    names = list(classes) if classes is not None else list(mixture.classes)
    labels = row_labels(dataset) if exact_classes and names else None
    return {"split": dataset.config.split, "seed": mixture.seed, "class_map": mix.class_map, "classes": names,
            "epoch_size": mixture.epoch_size,
            "epochs": [{"epoch": epoch + 1, "sources": epoch_composition(mixture, names, epoch, labels)}
                       for epoch in range(int(epochs))]}


def describe_amount(source: Mapping[str, Any]) -> str:
    """How a source fills the epoch, as its spec says: ``weight 0.7``, ``repeat 2``, ``choose 100`` (also for a
    run's recorded composition, so any value is shown as it is)."""
    for name in ("weight", "choose", "repeat"):
        value = source.get(name)
        if value is not None:
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            return f"{name} {value:g}" if numeric else f"{name} {value}"
    return "repeat 1"


def describe_subset(subset: Any) -> str:
    """A source's subset in one line: ``classes a,b; where width >= 256; at most 100``, or ``all``."""
    if not subset:
        return "all"
    if not isinstance(subset, Mapping):
        return str(subset)
    classes = subset.get("classes")
    parts = []
    if classes:
        parts.append("classes " + (",".join(map(str, classes)) if isinstance(classes, list) else str(classes)))
    for key, label in (("keys", "keys"), ("where", "where"), ("max_samples", "at most")):
        if subset.get(key):
            parts.append(f"{label} {subset[key]}")
    return "; ".join(parts) or "all"


def _class_lines(report: dict[str, Any], sources: list[dict[str, Any]]) -> list[str]:
    # Only the classes drawn: a subset of a few classes out of a thousand lists those few.
    classes = [c for c in report["classes"] if any(c in s.get("drawn_class_counts", {}) for s in sources)]
    expected = [str(i + 1) for i, s in enumerate(sources) if s.get("drawn_class_counts_basis") == "expected"]
    kind = "exact" if not expected else "expected" if len(expected) == len(sources) else \
        f"exact; expected for source {', '.join(expected)}"
    head = "".join(f"{f'source {i + 1}':>12}" for i in range(len(sources)))
    width = max([len(c) for c in classes[:MAX_CLASS_LINES]] + [5])
    lines = [f"    classes drawn ({kind}):", "    " + "class".ljust(width) + head + f"{'total':>12}"]
    for name in classes[:MAX_CLASS_LINES]:
        values = [s.get("drawn_class_counts", {}).get(name, 0) for s in sources]
        lines.append("    " + name.ljust(width) + "".join(f"{v:>12g}" for v in values) + f"{sum(values):>12g}")
    if len(classes) > MAX_CLASS_LINES:
        lines.append(f"    ... {len(classes) - MAX_CLASS_LINES} more classes drawn, in the JSON")
    return lines


def format_mixture(report: dict[str, Any]) -> str:
    """A human-readable table of ``mixture_report``'s result: the sources (the same every epoch), then each
    epoch's classes drawn (an epoch drawing what the one before drew says so)."""
    first = report["epochs"][0]["sources"]
    lines = [f"mixture of {len(first)} source(s), split {report['split']}, class map {report['class_map']}, "
             f"{report['epoch_size']} samples per epoch, seed {report['seed']}",
             f"  {'source':<8}{'amount':<14}{'available':>10}{'drawn':>8}{'share':>8}{'passes':>8}{'shards':>8}"
             "  path (subset)"]
    for i, s in enumerate(first):
        lines.append(f"  {i + 1:<8}{describe_amount(s):<14}{s['available']:>10}{s['drawn']:>8}"
                     f"{100 * s['share']:>7.1f}%{s['passes']:>8.2f}{s['shards']:>8}  {s['path']} "
                     f"({describe_subset(s.get('subset'))})")
    if not report["classes"]:
        return "\n".join(lines)
    previous = None
    for epoch in report["epochs"]:
        counts = [s.get("drawn_class_counts") for s in epoch["sources"]]
        if counts == previous:
            lines.append(f"  epoch {epoch['epoch']}: the same classes drawn as epoch {epoch['epoch'] - 1}")
            continue
        lines.append(f"  epoch {epoch['epoch']}:")
        lines += _class_lines(report, epoch["sources"])
        previous = counts
    if any(s.get("drawn_class_counts_basis") == "expected" for e in report["epochs"] for s in e["sources"]):
        lines.append("  expected: selected counts times passes, for a source drawn a fraction of a pass (which of "
                     "its shard runs fill it changes every epoch); exact_classes (--exact-classes) counts them")
    return "\n".join(lines)
