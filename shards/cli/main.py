"""The ``shards`` console script: verify, inspect and report on shard folders, feature caches and runs.

Human-readable text goes to stderr (silenced by ``--quiet``); one JSON line with the result goes to stdout.
"""

from __future__ import annotations

import difflib
import sys

import click

from shards.cli.common import (
    EXIT_FAILED, S3_OPTION_NAMES, cache_option, class_names, emit_json, handle_errors, overwrite_option, quiet_option,
    s3_options, seed_option, shard_source_option, version_option, workers_option)
from shards.cli.sections import SectionedCommand
from shards.cli.exits import OneLineUsage
from shards.check.inspect import batch_report, format_mixture, format_summary, mixture_report, save_grid, summarize
from shards.check.verify import verify_dataset
from shards.check.verify_core import DEFAULT_SAMPLES_PER_SHARD
from shards.select.mixture import CLASS_MAPS, MixOptions, SourceSpec, Subset


COMMANDS_GROUP = "shards.commands"  # entry points: commands other packages add (shards index, from preprocess)


class _Commands(OneLineUsage, click.Group):
    """The group's own commands plus those registered under the ``shards.commands`` entry-point group: ``shards``
    imports nothing from the job packages (tests/test_layout.py), yet ``shards index`` runs one of their jobs."""

    def _plugins(self) -> dict:
        from importlib.metadata import entry_points

        return {point.name: point for point in entry_points(group=COMMANDS_GROUP)}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._plugins()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        own = super().get_command(ctx, name)
        if own is not None:
            return own
        point = self._plugins().get(name)
        return None if point is None else point.load()

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple:
        """click suggests among the group's own commands only; the registered ones (``shards index``) count too."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1)
            ctx.fail(f"No such command {name!r}." + (f" Did you mean {close[0]!r}?" if close else ""))
        return super().resolve_command(ctx, args)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@version_option
def main() -> None:
    """Verify, inspect and report on shardcache folders."""


@main.command("verify", cls=SectionedCommand,
              sections={"Checks": ("full", "samples_per_shard", "workers", "source"),
                        "Object storage": S3_OPTION_NAMES})
@click.argument("folder", type=click.Path(path_type=str))
@click.option("--full", is_flag=True, help="Decode every image, not a sample per shard.")
@click.option("--samples-per-shard", type=int, default=DEFAULT_SAMPLES_PER_SHARD, show_default=True,
              help="Images decoded per shard without --full.")
@workers_option("Processes checking shards side by side")
@shard_source_option(where="in FOLDER")
@s3_options
@quiet_option
@handle_errors
def verify_command(folder: str, full: bool, samples_per_shard: int, workers: int, source: str | None,
                   quiet: bool, s3) -> None:
    """Recompute checksums and counts and decode images; exit 1 naming the shard and sample on any problem.
    FOLDER may be s3://bucket/prefix (each shard is read in one streaming GET)."""
    report = verify_dataset(folder, full=full, samples_per_shard=samples_per_shard, storage_options=s3,
                            workers=max(1, workers), quiet=quiet, source=source)
    for problem in report.problems:
        click.echo(f"error: {problem}", err=True)
    if report.ok and not quiet:
        click.echo(f"{folder}: ok ({report.shards_checked} shards, {report.samples_read} samples read, "
                   f"{report.samples_decoded} decoded)", err=True)
    emit_json(report.to_dict())
    if not report.ok:
        sys.exit(EXIT_FAILED)


@main.command("inspect", cls=SectionedCommand,
              sections={"Batch and grid": ("show_batch", "batch_size", "split", "image_size", "grid_path",
                                           "grid_count", "seed"),
                        "Mixture and subset": ("mix_sources", "classes", "where", "max_samples", "class_map",
                                               "epoch_size", "epochs", "exact_classes"),
                        "Object storage": S3_OPTION_NAMES})
@click.argument("folder", type=click.Path(path_type=str), required=False)
@click.option("--batch", "show_batch", is_flag=True,
              help="Load one batch with the eval transform; print shape, dtype, value range, labels.")
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--split", default=None,
              help="Split for --batch (default val), --grid and a mixture (default train).")
@click.option("--image-size", type=int, default=224, show_default=True)
@click.option("--grid", "grid_path", type=click.Path(path_type=str), default=None,
              help="Save a PNG grid of augmented training images here.")
@click.option("--grid-count", type=int, default=16, show_default=True)
@seed_option("the grid's augmentations, and of a mixture's epochs (training's --seed)")
@click.option("--mix", "mix_sources", multiple=True, metavar="PATH[:WEIGHT]",
              help="A source of a mixture, repeated for each: PATH, PATH:WEIGHT, PATH:repeat=R or PATH:choose=N. "
                   "Replaces FOLDER.")
@click.option("--classes", default=None, metavar="A,B", help="Subset: only these classes (comma-separated).")
@click.option("--where", default=None, metavar="EXPR",
              help="Subset: a filter on sample metadata, e.g. \"width >= 256\".")
@click.option("--max-samples", type=int, default=None, help="Subset: at most this many samples per source.")
@click.option("--class-map", type=click.Choice(CLASS_MAPS), default=None,
              help="How sources' classes combine: the same lists (default), or the union of names.")
@click.option("--epoch-size", type=int, default=None, help="Samples per epoch of weighted sources (default: "
                                                            "their selected samples together).")
@click.option("--epochs", type=int, default=None, help="Epochs of a mixture to describe (default 1).")
@click.option("--exact-classes", is_flag=True,
              help="Read every selected shard's labels (nothing decoded) so each epoch's class counts are exact; "
                   "without it a source drawn a fraction of a pass reports the expected counts.")
@s3_options
@quiet_option
@handle_errors
def inspect_command(folder: str | None, show_batch: bool, batch_size: int, split: str | None, image_size: int,
                    grid_path: str | None, grid_count: int, seed: int, mix_sources: tuple[str, ...],
                    classes: str | None, where: str | None, max_samples: int | None, class_map: str | None,
                    epoch_size: int | None, epochs: int | None, exact_classes: bool, quiet: bool, s3) -> None:
    """Classes with counts, shards and sizes; optionally one batch's statistics and an augmentation grid.
    FOLDER may be s3://bucket/prefix.

    With --mix sources (or FOLDER with --classes, --where or --max-samples), what each epoch of that mixture
    holds, as training would read it: per source the samples available and drawn, share of the epoch, passes,
    and the classes drawn (exact, or marked expected)."""
    subset = _subset(classes, where, max_samples)
    if mix_sources or not subset.empty:
        if show_batch or grid_path is not None:
            raise click.UsageError("--batch and --grid read one whole FOLDER; leave them out with --mix or a "
                                   "subset (--classes, --where, --max-samples)")
        specs = _sources(folder, mix_sources, subset)
        result = mixture_report(specs, split or "train", mix=MixOptions(class_map=class_map or "same",
                                                                       epoch_size=epoch_size),
                                seed=seed, epochs=1 if epochs is None else epochs, exact_classes=exact_classes,
                                storage_options=s3)
        if not quiet:
            click.echo(format_mixture(result), err=True)
        emit_json(result)
        return
    if folder is None:
        raise click.UsageError("give a FOLDER, or --mix sources")
    mixture_only = {"--class-map": class_map, "--epoch-size": epoch_size, "--epochs": epochs,
                    "--exact-classes": exact_classes or None}
    given = [name for name, value in mixture_only.items() if value is not None]
    if given:
        raise click.UsageError(f"{', '.join(given)} describe a mixture: add --mix sources or a subset "
                               "(--classes, --where, --max-samples)")
    result = summarize(folder, storage_options=s3)
    if not quiet:
        click.echo(format_summary(result), err=True)
    if show_batch:
        result["batch"] = batch_report(folder, split=split, batch_size=batch_size, image_size=image_size,
                                       storage_options=s3)
        if not quiet:
            b = result["batch"]
            click.echo(f"  batch ({b['split']}): shape {b['shape']} {b['dtype']}, range [{b['min']}, {b['max']}], "
                       f"mean {b['mean']}, std {b['std']}, labels {b['label_counts']}", err=True)
    if grid_path is not None:
        result["grid"] = save_grid(folder, grid_path, split=split, count=grid_count, image_size=image_size,
                                   seed=seed, storage_options=s3)
        if not quiet:
            click.echo(f"  grid: {grid_path} ({result['grid']['images']} images)", err=True)
    emit_json(result)


def _subset(classes: str | None, where: str | None, max_samples: int | None) -> Subset:
    return Subset(classes=class_names(classes), where=where, max_samples=max_samples)


def _sources(folder: str | None, mix_sources: tuple[str, ...], subset: Subset) -> list[SourceSpec]:
    if folder is not None and mix_sources:
        raise click.UsageError("give FOLDER or --mix sources, not both (FOLDER is one more --mix)")
    if not mix_sources:
        return [SourceSpec(folder, subset=subset)]  # type: ignore[arg-type]
    return [SourceSpec.parse(text, subset=subset, option="--mix") for text in mix_sources]


@main.command("report")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--out", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="The HTML file to write. Default: PATH/report.html for one folder, else ./report.html.")
@click.option("--no-grid", is_flag=True, help="Leave out the sample images (no shard is opened).")
@shard_source_option(whose="the shards of the sample images")
@quiet_option
@handle_errors
def report_command(paths: tuple[str, ...], out: str | None, no_grid: bool, source: str | None, quiet: bool) -> None:
    """One self-contained HTML page (no network, opens in any browser) for each dataset (dataset.json), feature
    cache (features.json) or training run (metrics.jsonl + config.json) given, and the local folders they name."""
    from shards.atomic import check_local_output
    from shards.report.build import check_report_out, default_out, make_report
    from shards.report.samples import GridOptions

    if out is not None:
        check_local_output(out)
    target = out if out is not None else default_out(paths)
    check_report_out(target)  # before any work: a report never replaces a manifest or a file of yours
    report = make_report(list(paths), grid=False if no_grid else GridOptions(source=source))
    target = report.write(target)
    if not quiet:
        click.echo(f"report: {target} ({', '.join(s['kind'] for s in report.summary())})", err=True)
    emit_json({"out": str(target), "sections": report.summary()})


@main.command("plan", cls=SectionedCommand,
              sections={"Layout": ("epochs", "world_size", "nodes", "workers", "batch_size", "split", "seed",
                                   "no_shuffle", "drop_last", "fresh_workers"),
                        "Node cache": ("cache", "cache_limit", "cache_eviction", "cache_prefetch", "cache_local"),
                        "Link and prices": ("request_ms", "mbps", "prices", "read_index"),
                        "Object storage": S3_OPTION_NAMES})
@click.argument("path", type=click.Path(path_type=str))
@click.option("--epochs", type=click.IntRange(1, 10_000), required=True, help="Epochs to forecast.")
@click.option("--world-size", type=click.IntRange(1, 1 << 16), default=1, show_default=True, help="Ranks.")
@click.option("--nodes", type=click.IntRange(1, 1 << 16), default=1, show_default=True,
              help="Nodes (one node cache each); must divide --world-size.")
@workers_option("DataLoader workers per rank of the run to forecast")
@click.option("--batch-size", type=click.IntRange(1, None), required=True, help="Samples per batch per rank.")
@click.option("--split", default="train", show_default=True)
@seed_option("the run to forecast (its --seed)", value_type=click.IntRange(0, None))
@click.option("--no-shuffle", is_flag=True, help="The run reads without shuffling.")
@click.option("--drop-last", is_flag=True, help="Equal rank shares by leaving samples out (not padding).")
@click.option("--fresh-workers", is_flag=True,
              help="Workers start anew each epoch (not persistent): each loads the byte indexes again.")
@click.option("--cache", is_flag=True, help="Shards go through a node-local cache (implied by --cache-limit).")
@cache_option("--cache-limit")
@cache_option("--cache-eviction")
@cache_option("--cache-prefetch")
@cache_option("--cache-local")
@click.option("--request-ms", type=click.FloatRange(0, None), default=None,
              help="Milliseconds per request round trip, for the time to the first batch.")
@click.option("--mbps", type=click.FloatRange(0, None, min_open=True), default=None,
              help="A node's link to storage in megabits per second, for the time to the first batch.")
@click.option("--prices", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="A price table (JSON; docs/prices-s3-example.json) to bill the requests and bytes by.")
@click.option("--read-index", is_flag=True,
              help="Read the tar shards' byte indexes (.idx sidecars, no shard) for exact slice bytes.")
@s3_options
@quiet_option
@handle_errors
def plan_command(path: str, epochs: int, world_size: int, nodes: int, workers: int, batch_size: int, split: str,
                 seed: int, no_shuffle: bool, drop_last: bool, fresh_workers: bool, cache: bool,
                 cache_limit: int | None, cache_eviction: str, cache_prefetch: int | None, cache_local: bool,
                 request_ms: float | None,
                 mbps: float | None, prices: str | None, read_index: bool, quiet: bool, s3) -> None:
    """What each epoch of a run will ask of storage, from the manifest and the order alone (no shard is read):
    per epoch and rank the requests and bytes from the source, those read ahead and the byte indexes, the node
    cache's hits, misses and evictions (its own rules played forward), the time to the first batch (with
    --request-ms and --mbps) and the bill (with --prices). PATH may be s3://bucket/prefix."""
    import shards
    from shards.cache.node import ShardCache
    from shards.forecast.plan import Link, forecast
    from shards.forecast.prices import load_prices
    from shards.forecast.text import format_forecast
    from shards.loader.loader import workers_mode

    node_cache = None
    if cache or cache_limit is not None or cache_local:
        options = {"prefetch_bytes": cache_prefetch} if cache_prefetch is not None else {}
        node_cache = ShardCache(limit=cache_limit, eviction=cache_eviction, local=True if cache_local else None,
                                **options)
    link = None if request_ms is None and mbps is None else Link(request_ms or 0.0, mbps)
    # The run's own dataset (rank 0 of its layout: every rank's rows come from its epoch source) and run mode.
    sampling = shards.Sampling(shuffle=not no_shuffle, balance="drop" if drop_last else "pad")
    dataset = shards.open_dataset(path, split, seed=seed, sampling=sampling, remote=shards.Remote(storage_options=s3),
                                  distributed=shards.Distributed(rank=0, world_size=world_size, nodes=nodes))
    result = forecast(dataset, workers_mode(workers, persistent=not fresh_workers), epochs, batch_size=batch_size,
                      cache=node_cache, link=link, prices=None if prices is None else load_prices(prices),
                      read_index=read_index).to_dict()
    if not quiet:
        click.echo(format_forecast(result), err=True)
    emit_json(result)


@main.command("lineage")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=str))
@click.option("--epoch", type=int, required=True, help="The epoch, from 1 (as metrics.jsonl counts).")
@click.option("--step", type=int, required=True,
              help="The global step, from 1 across epochs (the step counter metrics.jsonl reports).")
@click.option("--rank", type=int, default=None, help="One rank's samples (default: every rank's).")
@quiet_option
@handle_errors
def lineage_command(run_dir: str, epoch: int, step: int, rank: int | None, quiet: bool) -> None:
    """The sample keys (with shard and row) a train-from-shards step was fed, computed from the run's record
    (run.json: the loader call it made) and data-events.jsonl (layouts, resumes, quarantines), not from per-step
    logs."""
    from shards.check.lineage import run_lineage

    emit_json(run_lineage(run_dir, epoch, step, rank))


@main.command("audit")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=str))
@quiet_option
@handle_errors
def audit_command(run_dir: str, quiet: bool) -> None:
    """Check every resume a train-from-shards run folder records: the loader state each resume continued holds
    the keys of the last batches fed and of the next ones planned, compared again with the plan and the shards now
    (docs/training.md, "Resume audit"). Prints one JSON line; exit 1 on any mismatch or unreadable record."""
    from shards.check.audit import audit_run

    result = audit_run(run_dir)
    if not quiet:
        click.echo(f"{result['resumes']} resume(s), {result['audited']} audited, {result['mismatches']} "
                   f"mismatch(es)" + (f", {result['unreadable']} unreadable record(s)" if result["unreadable"] else ""),
                   err=True)
        for row in result["results"]:
            if row["result"] in ("mismatch", "invalid", "unreadable"):
                click.echo(row["message"], err=True)
    emit_json(result)
    if result["mismatches"] or result["unreadable"]:
        sys.exit(EXIT_FAILED)


@main.command("export-index", cls=SectionedCommand,
              sections={"Index": ("out", "split", "url_base", "overwrite"),
                        "Object storage": S3_OPTION_NAMES})
@click.argument("dataset", type=click.Path(path_type=str))
@click.option("--out", type=click.Path(dir_okay=False, path_type=str), required=True,
              help="The index file to write (.json, on this machine).")
@click.option("--split", default="train", show_default=True, help="The split the index lists.")
@click.option("--url-base", default=None, metavar="URL",
              help="Where wids will read the shards (a folder, s3:// or https:// prefix); each url is URL/<shard>. "
                   "Default: relative to the index for a local dataset (move both together), else the dataset's "
                   "own location.")
@overwrite_option("an earlier wids index at --out")
@s3_options
@quiet_option
@handle_errors
def export_index_command(dataset: str, out: str, split: str, url_base: str | None, overwrite: bool, quiet: bool,
                         s3) -> None:
    """Write a wids shard index (wids-shard-index-v1) of one split of a tar dataset, so webdataset's random-access
    reader (wids.ShardListDataset(INDEX)) opens the shards without shardcache. DATASET may be s3://bucket/prefix."""
    from shards.publish.wids_index import export_wids_index

    result = export_wids_index(dataset, split, out, url_base=url_base, overwrite=overwrite, storage_options=s3)
    if not quiet:
        click.echo(f"{out}: wids index of {dataset} ({split}: {result.shards} shards, {result.samples:,} samples, "
                   f"{'relative' if result.relative_urls else 'absolute'} urls)", err=True)
    emit_json(result.to_dict())
