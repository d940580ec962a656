"""A labelled grid of a few real images per class, read from the shards the way training reads them.

Looking at the pictures catches what no count does (a class folder full of the wrong images, labels swapped, all
black frames). The shards are read with the library's own reader in manifest order, so the confinement and
format checks of training apply; samples arrive still encoded and only the ones shown are decoded (JPEG drafts at
reduced size), within a sample and time budget so a report of a huge or class-sorted dataset stays quick.
"""

from __future__ import annotations

import io
import os
import time
from dataclasses import dataclass
from pathlib import Path

from shards.errors import ShardcacheError
from shards.manifest import DATASET_FILE, DatasetManifest
from shards.report.html import Markup, figure, image_data_uri, join, note, tag, void

THUMB_PX = 128
DRAFT_PX = (2 * THUMB_PX, 2 * THUMB_PX)


@dataclass(frozen=True)
class GridOptions:
    """How much to show and how long to look: a training run redraws its report as epochs end, so the scan is bounded."""

    per_class: int = 4
    max_classes: int = 40
    max_scan: int = 4000  # samples read (not decoded) at most
    max_seconds: float = 3.0
    source: str | None = None  # where the shards are when not beside the manifest (an index of adopted tars)


@dataclass(frozen=True)
class Thumb:
    label: int
    key: str
    uri: str | None  # None: the sample could not be decoded
    problem: str | None = None


def _keep_encoded(sample, seed: int = 0):
    """The reader's decode stage, replaced: the grid decodes only the samples it shows."""
    return sample


def _thumbnail(data: bytes, ext: str) -> str:
    from shards.image.decode import ImageDecoder

    image = ImageDecoder(draft_size=DRAFT_PX).decode(data, ext)
    image.thumbnail((THUMB_PX, THUMB_PX))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=82)
    return image_data_uri(buffer.getvalue(), "image/jpeg")


def pick_split(manifest: DatasetManifest) -> str | None:
    if "train" in manifest.splits and manifest.splits["train"].samples > 0:
        return "train"
    return next((name for name, split in manifest.splits.items() if split.samples > 0), None)


_CACHE: dict[tuple, list[Thumb]] = {}
CACHE_ENTRIES = 4


def _cache_key(folder: Path, split: str, options: GridOptions) -> tuple:
    """A dataset is identified by its manifest file: rewriting ``dataset.json`` (an append, a repack) changes it."""
    stat = (Path(folder) / DATASET_FILE).stat()
    return os.path.realpath(folder), split, stat.st_mtime_ns, stat.st_size, stat.st_ino, options


def collect_thumbs(folder: Path, manifest: DatasetManifest, split: str, options: GridOptions) -> list[Thumb]:
    """Up to ``per_class`` thumbnails for each of the first ``max_classes`` classes, in manifest order; remembered
    per process, so a training run redrawing its report decodes them once."""
    key = _cache_key(folder, split, options)
    if key not in _CACHE:
        thumbs = _read_thumbs(folder, manifest, split, options)
        while len(_CACHE) >= CACHE_ENTRIES:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = thumbs
    return list(_CACHE[key])


def _read_thumbs(folder: Path, manifest: DatasetManifest, split: str, options: GridOptions) -> list[Thumb]:
    from shards.stream.options import Decode, Distributed, Remote, Sampling
    from shards.stream.reader import open_dataset

    wanted = {label: options.per_class for label in range(min(len(manifest.classes), options.max_classes))}
    dataset = open_dataset(folder, split, sampling=Sampling(shuffle=False), return_keys=True,
                           distributed=Distributed(rank=0, world_size=1), remote=Remote(base_url=options.source),
                           decode=Decode(mode="standard", decoder=_keep_encoded))
    thumbs: list[Thumb] = []
    deadline = time.monotonic() + options.max_seconds
    for scanned, (raw, label, key) in enumerate(dataset):
        label = int(label)
        if wanted.get(label, 0) > 0:
            wanted[label] -= 1
            try:
                thumbs.append(Thumb(label, str(key), _thumbnail(raw.data, raw.ext)))
            except ShardcacheError as exc:
                thumbs.append(Thumb(label, str(key), None, str(exc)))
            if not any(wanted.values()):
                break
        if scanned + 1 >= options.max_scan or time.monotonic() > deadline:
            break
    return thumbs


def sample_grid(folder: Path, manifest: DatasetManifest, options: GridOptions = GridOptions()) -> Markup:
    """The grid, class name under each image; a note instead when there is nothing to show or reading failed."""
    split = pick_split(manifest)
    if split is None:
        return note("No samples to show: every split is empty.")
    try:
        thumbs = collect_thumbs(folder, manifest, split, options)
    except ShardcacheError as exc:
        return note(f"Could not read samples from the {split} split: {exc}", "bad")
    thumbs.sort(key=lambda thumb: thumb.label)
    figures = []
    for thumb in thumbs:
        name = manifest.classes[thumb.label]
        if thumb.uri is None:
            picture = tag("div", "undecodable", class_="note bad", title=thumb.problem)
        else:
            picture = void("img", src=thumb.uri, alt=name, title=f"{name} / {thumb.key}")
        figures.append(figure(picture, name))
    shown = {thumb.label for thumb in thumbs}
    considered = min(len(manifest.classes), options.max_classes)
    missing = [manifest.classes[label] for label in range(considered) if label not in shown]
    notes = []
    if len(manifest.classes) > considered:
        notes.append(f"the first {considered} of {len(manifest.classes)} classes")
    if missing:
        notes.append(f"no sample found within the first {options.max_scan:,} samples or "
                     f"{options.max_seconds:g} s for: {', '.join(missing[:12])}{' ...' if len(missing) > 12 else ''}")
    caption = f"{options.per_class} per class from the {split} split, in shard order"
    caption += f" ({'; '.join(notes)})" if notes else ""
    return tag("div", join(figures), class_="samples") + tag("p", caption, class_="note")
