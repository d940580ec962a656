"""The report's section for an image dataset (a folder with ``dataset.json``).

Everything but the sample grid comes from the manifest alone, which is the contract training reads: if the counts
here look wrong, training sees the same wrong counts. The manifest is untrusted, so list lengths that disagree with
the class list are shown as they are (blank or extra), not trusted to line up.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Sequence

from shards.manifest import DatasetManifest
from shards.report import svg
from shards.report.html import (Cell, Markup, Section, count, join, key_values, note, num_cell, pct, size,
                                subsection, table, tag, tiles)
from shards.report.samples import GridOptions, sample_grid

MAX_CLASS_BARS = 40  # beyond this a bar per class is unreadable: the sorted profile is shown instead
MAX_TABLE_ROWS = 2000
IMBALANCE_WARN = 10.0


def class_counts(manifest: DatasetManifest, split: str) -> list[int | None]:
    """One count per class (None where the manifest's list is short)."""
    counts = list(manifest.splits[split].class_counts)
    return [counts[i] if i < len(counts) else None for i in range(len(manifest.classes))]


def imbalance(counts: Sequence[int | None]) -> dict[str, float | int | None]:
    """Largest over smallest class, and the effective number of classes (exp of the label entropy)."""
    present = [c for c in counts if c]
    total = sum(present)
    if not present:
        return {"ratio": None, "effective": None, "empty": len(counts)}
    entropy = -sum(c / total * math.log(c / total) for c in present)
    return {"ratio": max(present) / min(present), "effective": math.exp(entropy),
            "empty": sum(1 for c in counts if not c)}


def _overview(manifest: DatasetManifest) -> Markup:
    splits = manifest.splits
    total_bytes = sum(shard.bytes for split in splits.values() for shard in split.shards)
    train = "train" if "train" in splits else next(iter(splits), None)
    ratio = None if train is None else imbalance(class_counts(manifest, train))["ratio"]
    skipped = len(manifest.source.skipped)
    items = [("classes", count(len(manifest.classes)), None),
             ("samples", count(sum(s.samples for s in splits.values())), None)]
    items += [(f"{name} samples", count(split.samples), None) for name, split in splits.items()]
    items += [("shards", count(sum(len(s.shards) for s in splits.values())), None),
              ("on disk", size(total_bytes), None),
              ("skipped at pack time", count(skipped), "warn" if skipped else "good")]
    if ratio is not None:
        items.append((f"imbalance ({train}, max/min)", f"{ratio:.1f}x", "warn" if ratio >= IMBALANCE_WARN else None))
    return tiles(items)


def _classes(manifest: DatasetManifest) -> Markup:
    names = list(manifest.splits)
    per_split = {name: class_counts(manifest, name) for name in names}
    charts = [svg.hbars(names, [("samples", [float(manifest.splits[n].samples) for n in names])], count,
                        title="samples per split")]
    if len(manifest.classes) <= MAX_CLASS_BARS:
        charts.append(svg.hbars(list(manifest.classes), [(n, [c if c is None else float(c) for c in per_split[n]])
                                                         for n in names], count, title="samples per class"))
    else:
        first = names[0] if names else None
        ordered = sorted((c or 0 for c in per_split.get(first, [])), reverse=True)
        charts.append(svg.columns([str(i + 1) for i in range(len(ordered))], [(first or "", ordered)], count,
                                  title="class counts, sorted", x_title=f"classes by {first} count (rank)",
                                  integer=True))
    totals = [sum(per_split[n][i] or 0 for n in names) for i in range(len(manifest.classes))]
    grand = sum(totals) or 1
    rows = [[Cell(str(i), float(i)), name] + [num_cell(per_split[n][i]) for n in names]
            + [num_cell(totals[i]), num_cell(totals[i] / grand, pct)]
            for i, name in enumerate(manifest.classes[:MAX_TABLE_ROWS])]
    listed = table(["label", "class", *names, "total", "share"], rows, scroll=True)
    more = note(f"The first {MAX_TABLE_ROWS:,} of {len(manifest.classes):,} classes are listed.") \
        if len(manifest.classes) > MAX_TABLE_ROWS else Markup("")
    return subsection("Splits and classes", tag("div", join(tag("figure", c) for c in charts), class_="grid2")
                      + listed + more)


def _imbalance(manifest: DatasetManifest) -> Markup:
    rows, warnings = [], []
    classes = len(manifest.classes)
    for name in manifest.splits:
        counts = class_counts(manifest, name)
        stats = imbalance(counts)
        present = [(c, i) for i, c in enumerate(counts) if c]
        small = min(present) if present else None
        large = max(present) if present else None
        rows.append([name, Cell(manifest.classes[small[1]] if small else "n/a"), num_cell(small and small[0]),
                     Cell(manifest.classes[large[1]] if large else "n/a"), num_cell(large and large[0]),
                     num_cell(stats["ratio"], lambda v: "n/a" if v is None else f"{v:.2f}x"),
                     num_cell(stats["effective"], lambda v: "n/a" if v is None else f"{v:.1f} of {classes}"),
                     num_cell(stats["empty"])])
        if stats["empty"]:
            warnings.append(f"{name}: {stats['empty']} class(es) have no samples")
        if stats["ratio"] is not None and stats["ratio"] >= IMBALANCE_WARN:
            warnings.append(f"{name}: the largest class is {stats['ratio']:.1f}x the smallest; consider "
                            "--class-weighted-loss or --balanced-sampler")
    body = table(["split", "smallest class", "samples", "largest class", "samples", "max/min",
                  "effective classes", "empty classes"], rows)
    body += join(note(w, "warn") for w in warnings) if warnings else note(
        "Effective classes: exp of the label entropy; it equals the class count when every class is equally "
        "frequent.")
    return subsection("Class imbalance", body)


def _histogram(values: Sequence[float], fmt, max_bins: int = 12) -> tuple[list[str], list[float]]:
    """Equal-width bins, as many as the data can fill (about 2 sqrt(n), at most the distinct values)."""
    low, high = min(values), max(values)
    if high - low < 1e-9:
        return [fmt(low)], [float(len(values))]
    bins = max(2, min(max_bins, len(set(values)), math.ceil(2 * math.sqrt(len(values)))))
    width = (high - low) / bins
    counts = Counter(min(bins - 1, int((v - low) / width)) for v in values)
    return [fmt(low + i * width) for i in range(bins)], [float(counts.get(i, 0)) for i in range(bins)]


def _shards(manifest: DatasetManifest) -> Markup:
    shards = [(name, shard) for name, split in manifest.splits.items() for shard in split.shards]
    if not shards:
        return subsection("Shards", note("No shards."))
    charts = []
    for title, values, fmt in (("shard size", [float(s.bytes) for _, s in shards], size),
                               ("samples per shard", [float(s.samples) for _, s in shards], count)):
        labels, counts = _histogram(values, fmt)
        charts.append(tag("figure", svg.columns(labels, [("shards", counts)], count, height=200, title=title,
                                                x_title=f"{title} (bin start)", integer=True)))
    rows = [[name, Cell(shard.path, mono=True), num_cell(shard.samples), num_cell(shard.bytes, size),
             Cell(shard.sha256[:16], mono=True), "yes" if shard.index else "no"]
            for name, shard in shards[:MAX_TABLE_ROWS]]
    more = note(f"The first {MAX_TABLE_ROWS:,} of {len(shards):,} shards are listed.") \
        if len(shards) > MAX_TABLE_ROWS else Markup("")
    return subsection("Shards", tag("div", join(charts), class_="grid2")
                      + table(["split", "shard", "samples", "bytes", "sha256", "byte index"], rows, scroll=True)
                      + more)


def _skipped(manifest: DatasetManifest) -> Markup:
    skipped = manifest.source.skipped
    if not skipped:
        return subsection("Skipped at pack time",
                          note(f"None: all {manifest.source.files_seen:,} files seen were packed.", "good"))
    reasons = Counter(" ".join(s.reason.split())[:120] for s in skipped).most_common(12)
    chart = svg.hbars([r for r, _ in reasons], [("files", [float(n) for _, n in reasons])], count, width=760,
                      label_chars=60, title="skipped files by reason")
    rows = [[Cell(s.path, mono=True), s.reason] for s in skipped[:MAX_TABLE_ROWS]]
    body = note(f"{len(skipped):,} of {manifest.source.files_seen:,} files seen were skipped; they are not in the "
                "shards.", "warn") + tag("figure", chart) + table(["file", "reason"], rows, scroll=True)
    if len(skipped) > MAX_TABLE_ROWS:
        body += note(f"The first {MAX_TABLE_ROWS:,} of {len(skipped):,} are listed.")
    return subsection("Skipped at pack time", body)


def _provenance(manifest: DatasetManifest) -> Markup:
    source = manifest.source
    items = [("storage", manifest.storage), ("source kind", source.kind), ("source root", source.root),
             ("files seen", f"{source.files_seen:,}"), ("created", manifest.created), ("tool", manifest.tool)]
    items += [(f"packing: {key}", value) for key, value in sorted(manifest.packing.items())]
    items += [(key, value) for key, value in sorted(manifest.extra.items())]
    return subsection("Packing options and provenance", key_values(items))


def dataset_section(folder: Path, manifest: DatasetManifest, anchor: str, *, grid: GridOptions | None,
                    links: Markup | None = None) -> Section:
    """The dataset's section; ``grid`` None leaves the sample images out (no shard is opened then)."""
    parts = [_overview(manifest), links or "", _classes(manifest), _imbalance(manifest)]
    if grid is not None:
        parts.append(subsection("Samples", sample_grid(folder, manifest, grid)))
    parts += [_shards(manifest), _skipped(manifest), _provenance(manifest)]
    return Section(anchor, "dataset", path=str(folder), title=folder.name or str(folder), body=join(parts))
