"""The ``pack-shards`` console script. It imports no torch (``precompute-features`` lives in preprocess/features/),
so ``pack-shards --help`` stays fast."""

from __future__ import annotations

import time
from pathlib import Path

import click

from preprocess.pack.api import pack_shards
from preprocess.pack.sources.members import SourceFields
from preprocess.pack.merge import merge_parts
from preprocess.pack.parts import STATE_DIR, read_plan_doc
from preprocess.pack.table.pack import pack_table
from preprocess.pack.table.config import ENCODINGS, IMPUTE_STATISTICS, TASKS, TableConfig
from shards.atomic import check_local_output, on_disk_full
from shards.lock import claim_output
from shards.cli.common import (S3_OPTION_NAMES, ByteSize, emit_json, handle_errors, overwrite_option, quiet_option,
                               s3_options, seed_option, staging_options, task_options, version_option,
                               workers_option)
from shards.cli.sections import SectionedCommand
from shards.image.decode import DEFAULT_MAX_PIXELS
from shards.errors import InputError
from shards.transport.storage import STORAGES

@click.command(cls=SectionedCommand, context_settings={"help_option_names": ["-h", "--help"]},
               sections={"Source": ("image_column", "label_column", "label_member", "label_field"),
                         "Validation": ("verify", "max_pixels", "strict", "allow_empty_classes"),
                         "Output and shards": ("out", "storage", "shard_samples", "max_bytes", "val_fraction", "seed",
                                               "no_shuffle", "resize_max_side", "quality", "overwrite",
                                               "append_new", "prune"),
                         "Tables (--table)": ("table", "target", "columns", "categorical", "encode", "impute",
                                              "table_task"),
                         "Parallel jobs": ("workers", "task_index", "num_tasks", "merge_dir"),
                         "Object storage": ("stage_dir", "break_lease", *S3_OPTION_NAMES)},
               common=("out", "shard_samples", "val_fraction", "workers", "append_new", "overwrite", "quiet"),
               examples=("pack-shards photos/ --out photos-shards --val-fraction 0.1",
                         "pack-shards photos/ --out photos-shards --append   # after photos/ grew"))
@click.argument("source", required=False, type=click.Path(path_type=str))
@click.option("--out", "-o", type=click.Path(path_type=str), help="Output folder for shards and dataset.json.")
@click.option("--storage", type=click.Choice(sorted(STORAGES)), default="tar", show_default=True,
              help="tar: WebDataset shards; hdf5: HDF5 shards.")
@click.option("--shard-samples", type=int, default=1000, show_default=True, help="Samples per shard at most.")
@click.option("--max-bytes", type=ByteSize(), default="256M", show_default=True, help="Bytes per shard at most.")
@click.option("--val-fraction", type=float, default=0.0, show_default=True,
              help="Carve a stratified val split from train when the source has none.")
@seed_option("the val split and the shuffle")
@click.option("--no-shuffle", is_flag=True, help="Keep source order instead of mixing samples across shards.")
@click.option("--verify", type=click.Choice(["header", "full"]), default="full", show_default=True,
              help="header: parse headers only (fast); full: decode every image (finds truncated data).")
@click.option("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, show_default=True,
              help="Skip images with more pixels (JPEGs are drafted down instead when re-encoding).")
@click.option("--resize-max-side", type=int, default=None, help="Re-encode to JPEG no larger than this side.")
@click.option("--quality", type=int, default=None, help="JPEG quality when re-encoding (default 90).")
@click.option("--strict", is_flag=True, help="Fail (exit 1) on the first unreadable image or non-regular file "
                                            "instead of skipping.")
@click.option("--allow-empty-classes", is_flag=True, help="Keep class folders that hold no images.")
@workers_option("Processes packing shards in parallel")
@overwrite_option("a different dataset already in --out")
@click.option("--append", "append_new", is_flag=True,
              help="Pack only source files not yet in OUT (known by relative path, size and mtime) into new shards, "
                   "with the packing options recorded in OUT/dataset.json; packed shards are never rewritten.")
@click.option("--prune", is_flag=True,
              help="With --append: drop files that disappeared or changed since packing (shards holding them are "
                   "copied without them into new shards; changed files are packed again).")
@click.option("--merge", "merge_dir", type=click.Path(path_type=str), default=None,
              help="Only merge the part manifests in this folder into dataset.json (after a task array).")
@staging_options("the shards are packed in")
@click.option("--image-column", default=None,
              help="Parquet/Arrow source: the column of image cells, binary or {bytes, path} structs (default: image).")
@click.option("--label-column", default=None,
              help="Parquet/Arrow source: the column of labels, integers or strings (default: label).")
@click.option("--label-member", default=None,
              help="WebDataset tars: the member holding each sample's label, e.g. cls (default: cls).")
@click.option("--label-field", default=None,
              help="WebDataset tars: the field of each sample's .json member holding its label.")
@click.option("--table", is_flag=True,
              help="SOURCE is a CSV table, not images: pack its rows as float32 feature shards and features.json "
                   "(what precompute-features writes), standardised with train-split statistics. A 'split' column "
                   "assigns the splits; otherwise --val-fraction (default 0.2 here) carves a stratified val split.")
@click.option("--target", default=None, help="With --table: the column to predict.")
@click.option("--columns", default=None, metavar="A,B,...",
              help="With --table: the input columns (default: all but the target and the split column).")
@click.option("--categorical", default=None, metavar="C,...",
              help="With --table: input columns holding categories (from the train split, sorted).")
@click.option("--encode", type=click.Choice(ENCODINGS), default="onehot", show_default=True,
              help="With --table: categories as one-hot columns or as one integer code (unseen: all-zero or -1).")
@click.option("--impute", type=click.Choice(IMPUTE_STATISTICS), default=None,
              help="With --table: fill missing numbers with this train-split statistic (recorded) and encode "
                   "missing categories as unknown. Default: a missing cell is an error naming its row and column.")
@click.option("--task", "table_task", type=click.Choice(TASKS), default="auto", show_default=True,
              help="With --table: auto infers classification from strings or integers with few distinct values.")
@task_options
@s3_options
@quiet_option
@version_option
@handle_errors
def pack_shards_command(source, out, storage, shard_samples, max_bytes, val_fraction, seed, no_shuffle, verify,
                        max_pixels, resize_max_side, quality, strict, allow_empty_classes, workers, overwrite,
                        append_new, prune, merge_dir, stage_dir, break_lease, image_column, label_column,
                        label_member, label_field, table, target, columns, categorical, encode, impute, table_task,
                        task_index, num_tasks, quiet, s3) -> None:
    """Pack an ImageFolder tree (or train/val/test trees, or a CSV/JSONL list), a Parquet file or folder, a
    datasets.save_to_disk folder, or WebDataset tars ('data/shard-{000..099}.tar') into shards in OUT, or
    (--table) the rows of a CSV table into feature shards.

    Prints a progress bar on stderr and one JSON summary line on stdout. Exit codes: 0 done, 1 failed,
    2 bad input or another run is writing OUT (nothing written). Files that are not regular files (FIFOs,
    devices), dangling symlinks and symlink loops are skipped and listed in dataset.json (--strict: exit 1).
    """
    given = _explicit_options(click.get_current_context())
    if not table:
        _refuse_options(given & TABLE_ONLY, "works only with --table")
    else:
        _refuse_options(given & IMAGE_ONLY, "applies to image packing, not --table")
        if source is None or out is None or target is None:
            raise InputError("give TABLE.csv, --target COLUMN and --out OUT")
        if num_tasks > 1:
            raise InputError("--table packs in one process; run it as a single task, not a task array")
        cfg = TableConfig(source=source, out=out, target=target, columns=_names(columns),
                          categorical=_names(categorical) or (), encode=encode, impute=impute, task=table_task,
                          val_fraction=val_fraction if "val_fraction" in given else None, seed=seed,
                          shuffle=not no_shuffle, max_samples=shard_samples,
                          storage="hdf5" if storage == "hdf5" else "pt", overwrite=overwrite)
        with on_disk_full(out):
            emit_json(pack_table(cfg).summary)
        return
    if merge_dir is not None:
        started = time.monotonic()
        check_local_output(merge_dir, "--merge")
        read_plan_doc(Path(merge_dir))  # a folder that was never packed: refuse before creating a lock file there
        with claim_output(merge_dir, STATE_DIR, what="pack-shards --merge", exclusive=True), on_disk_full(merge_dir):
            manifest = merge_parts(merge_dir)
        shards = [s for split in manifest.splits.values() for s in split.shards]
        emit_json({"out": merge_dir, "complete": True, "samples": sum(s.samples for s in shards),
                   "shards": len(shards), "bytes": sum(s.bytes for s in shards),
                   "skipped": len(manifest.source.skipped), "seconds": round(time.monotonic() - started, 3)})
        return
    if source is None or out is None:
        raise InputError("give SOURCE and --out OUT (or --merge OUT to merge part manifests)")
    emit_json(pack_shards(source, out, storage=storage, shard_samples=shard_samples, max_bytes=max_bytes,
                          val_fraction=val_fraction, seed=seed, no_shuffle=no_shuffle, verify=verify,
                          max_pixels=max_pixels, resize_max_side=resize_max_side, quality=quality, strict=strict,
                          allow_empty_classes=allow_empty_classes, workers=workers, overwrite=overwrite,
                          append=append_new, prune=prune,
                          source_fields=_source_fields(image_column, label_column, label_member, label_field),
                          stage_dir=stage_dir, break_lease=break_lease, task_index=task_index,
                          num_tasks=num_tasks, quiet=quiet, s3=s3))


# Options given on the command line that the other kind of packing would silently ignore are refused instead.
TABLE_ONLY = frozenset({"target", "columns", "categorical", "encode", "impute", "table_task"})
IMAGE_ONLY = frozenset({"max_bytes", "verify", "max_pixels", "resize_max_side", "quality", "strict",
                        "allow_empty_classes", "workers", "append_new", "prune", "merge_dir", "stage_dir",
                        "break_lease", "storage_tar", "image_column", "label_column", "label_member", "label_field"})


def _explicit_options(ctx: click.Context) -> set[str]:
    """The parameters the user gave (not defaults); ``--storage tar`` is image-only, ``hdf5`` serves both."""
    given = {name for name in ctx.params
             if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)}
    if "storage" in given and ctx.params["storage"] != "hdf5":
        given.add("storage_tar")
    return given


def _refuse_options(names: set[str], why: str) -> None:
    if names:
        flags = {"table_task": "--task", "append_new": "--append", "merge_dir": "--merge",
                 "storage_tar": "--storage tar"}
        shown = sorted(flags.get(name, "--" + name.replace("_", "-")) for name in names)
        raise InputError(f"{', '.join(shown)} {why}")


def _source_fields(image_column, label_column, label_member, label_field) -> SourceFields:
    """The options given, over ``SourceFields``' defaults."""
    given = {"image_column": image_column, "label_column": label_column, "label_member": label_member,
             "label_field": label_field}
    return SourceFields(**{name: value for name, value in given.items() if value is not None})


def _names(text: str | None) -> tuple[str, ...] | None:
    """``A, B,C`` -> ("A", "B", "C"); None when the option was not given."""
    if text is None:
        return None
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise InputError(f"{text!r} names no column")
    return names
