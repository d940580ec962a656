"""The report's section for a feature cache (a folder with ``features.json``).

The question a reader brings is "can I train on this, and is it still the features of my dataset?": so the
section leads with fresh or stale and why, judged by the one staleness rule in ``shards.check.freshness`` against
the dataset the manifest names (followed only as ``shards.door.locations.dataset_location`` allows).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from shards.errors import ShardcacheError
from shards.feature_stats import FeatureStatsSummary, read_summary, std_histogram
from shards.formats.feature_names import from_table
from shards.manifest import DATASET_FILE, FeatureManifest
from shards.report import svg
from shards.report.html import (Markup, Section, count, figure, join, key_values, note, num_cell, pct, size,
                                subsection, table, tag, tiles)


@dataclass(frozen=True)
class Freshness:
    state: str  # "fresh", "stale" or "unknown"
    reasons: tuple[str, ...]
    dataset_dir: Path | None  # the local dataset folder when it exists and was checked


def freshness(folder: Path, manifest: FeatureManifest) -> Freshness:
    """Fresh, stale (with every reason) or unknown (with why it could not be checked)."""
    from shards.check.freshness import feature_staleness
    from shards.transport.location import locate
    from shards.door.locations import dataset_location

    if from_table(manifest.config):
        return Freshness("fresh", ("packed from a table (pack-shards --table): no dataset to be stale against",),
                         None)
    location, why_not = dataset_location(folder, manifest.dataset_dir)
    if location is None:
        return Freshness("unknown", (str(why_not),), None)
    if locate(location).local_path() is None:
        why = f"the dataset is not on this machine ({location}); a report reads local folders only"
        return Freshness("unknown", (why,), None)
    location = Path(location)
    if not (location / DATASET_FILE).is_file():
        return Freshness("unknown", (f"the dataset it was computed from ({location}) is gone",), None)
    try:
        problems = feature_staleness(folder, manifest, location, deep=True)
    except ShardcacheError as exc:
        return Freshness("unknown", (f"the dataset at {location} cannot be read: {exc}",), None)
    return Freshness("stale" if problems else "fresh", tuple(problems), location)


def _describe_transform(transform: Any) -> str:
    if not isinstance(transform, dict):
        return "n/a" if transform is None else str(transform)
    parts = [f"{k}={transform[k]}" for k in ("resize", "crop", "interpolation") if k in transform]
    rest = {k: v for k, v in transform.items() if k not in ("resize", "crop", "interpolation")}
    parts += [f"{k}={v}" for k, v in sorted(rest.items())]
    return ", ".join(parts)


def _weights(config: Mapping[str, Any]) -> str:
    if "weights_sha256" not in config:
        return "not recorded"
    if config["weights_sha256"] is None:
        return f"none: random init from seed {config.get('init_seed', '?')}"
    return str(config["weights_sha256"])


def _freshness_note(state: Freshness) -> Markup:
    if state.state == "fresh" and state.dataset_dir is None:
        return note(f"Fresh: {state.reasons[0]}.", "good")
    if state.state == "fresh":
        return note(f"Fresh: computed from the current {DATASET_FILE} at {state.dataset_dir} and every image shard "
                    "it names.", "good")
    items = join(tag("li", reason) for reason in state.reasons)
    if state.state == "stale":
        return note(Markup("Stale: the dataset changed since these features were computed; rerun "
                           "precompute-features. Why:") + tag("ul", items), "bad")
    return note(Markup("Freshness unknown:") + tag("ul", items), "warn")


def _stats_body(summary: FeatureStatsSummary) -> Markup:
    """Tiles, the warnings precompute-features gave, and the per-dimension std: a histogram in decades when the
    manifest lists it, else its quantiles."""
    dead_tone = "warn" if summary.constant_dims else "good"
    parts = [tiles([("samples counted", count(summary.samples), None),
                    ("dead dims (constant)", f"{summary.constant_dims:,} / {summary.dims:,}", dead_tone),
                    ("all-zero dims", count(summary.zero_dims), "warn" if summary.zero_dims else None),
                    ("zeros stored", pct(summary.zero_share, 1), None),
                    (f"underflow in {summary.dtype}", pct(summary.underflow_share, 2),
                     "warn" if summary.warnings and summary.underflow_share > 0 else None),
                    ("value range", f"{summary.value_min:.4g} .. {summary.value_max:.4g}", None)])]
    parts += [note(f"precompute-features warned: {line}.", "warn") for line in summary.warnings]
    if summary.shards < summary.shards_total:
        parts.append(note(f"Counted over {summary.shards} of {summary.shards_total} feature shards (the others were "
                          "written before statistics were kept).", "warn"))
    if summary.std is not None:
        bins = std_histogram(summary.std)
        parts.append(figure(svg.columns([label for label, _ in bins], [("dimensions", [n for _, n in bins])],
                                        lambda v: f"{v:,.0f}", title="per-dimension std", x_title="std (decade)",
                                        integer=True, height=200),
                            "Feature dimensions by their standard deviation across samples; dead dimensions "
                            "(std 0) on the left."))
    quantiles = [[name, num_cell(value, lambda v: f"{v:.4g}")] for name, value in summary.std_quantiles.items()]
    parts.append(table(["per-dimension std", "value"], quantiles, sortable=False))
    return join(parts)


def _stats_part(folder: Path, manifest: FeatureManifest) -> Markup:
    """The per-dimension statistics precompute-features kept (``shards.feature_stats``): what a degenerate cache
    (all zero, dead dimensions, float16 underflow) looks like before anyone trains on it."""
    try:
        summary = read_summary(manifest.extra, str(folder / manifest.FILE))
    except ShardcacheError as exc:
        return subsection("Feature statistics", note(f"Unreadable: {exc}.", "warn"))
    if summary is None:
        return subsection("Feature statistics", note("Not recorded: this cache was written before precompute-features "
                                                     "kept per-dimension statistics."))
    return subsection("Feature statistics", _stats_body(summary))


def features_section(folder: Path, manifest: FeatureManifest, anchor: str, state: Freshness, *,
                     links: Markup | None = None) -> Section:
    config = manifest.config
    total_bytes = sum(shard.bytes for split in manifest.splits.values() for shard in split.shards)
    tone = {"fresh": "good", "stale": "bad", "unknown": "warn"}[state.state]
    overview = tiles([("cache", state.state, tone), ("backbone", str(config.get("backbone", "n/a")), None),
                      ("feature dim", count(manifest.features_dim), None), ("dtype", manifest.dtype, None),
                      ("views per image", count(manifest.views), None), ("on disk", size(total_bytes), None),
                      ("samples", count(sum(s.samples for s in manifest.splits.values())), None)])
    provenance = manifest.extra.get("provenance")
    items = [("backbone", config.get("backbone", "n/a")),
             ("weights sha256", _weights(config)),
             ("transform", _describe_transform(config.get("transform"))),
             ("augmented views", config.get("augment") if config.get("augment") else "none"),
             ("views", manifest.views), ("dtype", manifest.dtype), ("feature dim", manifest.features_dim),
             ("storage", manifest.storage), ("AMP", config.get("amp", "n/a")), ("decoder", config.get("decode", "n/a")),
             ("config hash", manifest.config_hash), ("dataset dir", manifest.dataset_dir),
             ("dataset.json sha256", manifest.dataset_sha256), ("created", manifest.created), ("tool", manifest.tool)]
    if isinstance(provenance, dict):
        items += [(f"provenance: {key}", value) for key, value in sorted(provenance.items())]
    rows = [[name, num_cell(split.samples), num_cell(len(split.shards)),
             num_cell(sum(s.bytes for s in split.shards), size)] for name, split in manifest.splits.items()]
    parts = [overview, _freshness_note(state), links or "",
             subsection("Splits", table(["split", "samples", "feature shards", "bytes"], rows)),
             _stats_part(folder, manifest),
             subsection("Backbone, transform and provenance", key_values(items))]
    return Section(anchor, "features", path=str(folder), title=folder.name or str(folder), body=join(parts))
