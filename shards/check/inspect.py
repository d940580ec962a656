"""``shards inspect``: what a folder holds, and what a model would actually be fed from it.

The summary (classes with counts, shards, sizes) comes from the manifest alone. ``batch_report`` runs one batch
through a DataLoader with the standard eval transform and reports shape, dtype, value range and label spread: the
first thing to look at when training misbehaves. ``save_grid`` writes augmented training images to look at.
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


def save_grid(folder: str | os.PathLike, out_path: str | os.PathLike, *, split: str | None = None,
              count: int = 16, image_size: int = 224, seed: int = 0, storage_options: Any = None) -> dict[str, Any]:
    """Save ``count`` training-augmented images (seeded) as one PNG grid, un-normalised so they look natural."""
    import torch
    from torchvision.utils import save_image

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
    grid = (images * std + mean).clamp(0, 1)
    out_path = Path(out_path)
    with atomic_output(out_path) as tmp:
        save_image(grid, tmp, nrow=min(8, len(grid)), padding=2, format="png")
    return {"grid": str(out_path), "images": len(grid), "split": split,
            "labels": [manifest.classes[int(label)] for label in labels]}
