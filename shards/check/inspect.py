"""``shards inspect``: what a folder holds, and what a model would actually be fed from it.

The summary (classes with counts, shards, sizes) comes from the manifest alone. ``batch_report`` runs one batch
through a DataLoader with the standard eval transform and reports shape, dtype, value range and label spread: the
first thing to look at when training misbehaves. ``save_grid`` writes augmented training images, each labelled
with its class name, to look at.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from shards.atomic import atomic_output
from shards.errors import InputError
from shards.manifest import DatasetManifest, load_dataset_manifest, load_manifest


def _manifest(folder: str | os.PathLike, storage_options: Any = None, *, images: bool = False):
    """The folder's manifest; ``s3://bucket/prefix`` is read from object storage."""
    if str(folder).startswith("s3://"):
        from shards.stream.reader import load_s3_manifest

        manifest = load_s3_manifest(str(folder), storage_options=storage_options)[0]
        if images and not isinstance(manifest, DatasetManifest):
            raise InputError("needs an image dataset (dataset.json), not a feature folder", path=str(folder))
        return manifest
    return load_dataset_manifest(folder) if images else load_manifest(folder)


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
    from shards.stream.loader import make_loader
    from shards.stream.options import Remote
    from shards.stream.reader import open_dataset

    dataset = open_dataset(folder, split, transform=transform, shuffle=shuffle, seed=seed, rank=0, world_size=1,
                           remote=Remote(storage_options=storage_options))
    return make_loader(dataset, batch_size, num_workers=0, drop_last=False, persistent_workers=False)


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

    folder = folder if str(folder).startswith("s3://") else Path(folder)
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

    folder = folder if str(folder).startswith("s3://") else Path(folder)
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
