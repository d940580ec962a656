"""``shards index``: the click shell over ``preprocess.adopt.index.index_tars``.

The command belongs to the ``shards`` console script but lives here, with the job it runs: ``shards`` imports
nothing from ``preprocess``, so it finds this command through the ``shards.commands`` entry-point group
(``pyproject.toml``; ``shards.cli.main``).
"""

from __future__ import annotations

import click

from preprocess.adopt.index import index_tars
from preprocess.pack.sources.members import DEFAULT_MAX_BYTES
from shards.cli.common import S3_OPTION_NAMES, ByteSize, emit_json, handle_errors, quiet_option, s3_options, seed_option
from shards.cli.sections import SectionedCommand


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(name.strip() for name in (text or "").split(",") if name.strip())


@click.command("index", cls=SectionedCommand, context_settings={"help_option_names": ["-h", "--help"]},
               sections={"Labels": ("label_member", "label_field"),
                         "Splits": ("val_fraction", "seed", "train_shards", "val_shards"),
                         "Output": ("out", "max_bytes"),
                         "Object storage": S3_OPTION_NAMES})
@click.argument("source", type=str)
@click.option("--out", required=True, type=click.Path(path_type=str),
              help="The index folder: everything shardcache writes goes here; the tars are only read.")
@click.option("--label-member", default=None, help="The member holding each sample's label, e.g. cls (default: cls).")
@click.option("--label-field", default=None, help="The field of each sample's .json member holding its label.")
@click.option("--val-fraction", type=float, default=0.0, show_default=True,
              help="Fraction of the tars drawn into the val split (by tar, from --seed; stable as tars are added).")
@seed_option("the --val-fraction draw")
@click.option("--train-shards", default=None, help="Comma-separated tar names (relative to the source) for train.")
@click.option("--val-shards", default=None, help="Comma-separated tar names (relative to the source) for val.")
@click.option("--max-bytes", type=ByteSize(), default=DEFAULT_MAX_BYTES, show_default=True,
              help="A sample larger than this (its members, as declared) is refused unread.")
@s3_options
@quiet_option
@handle_errors
def index_command(source: str, out: str, label_member: str | None, label_field: str | None, val_fraction: float,
                  seed: int, train_shards: str | None, val_shards: str | None, max_bytes: int, quiet: bool,
                  s3) -> None:
    """Index WebDataset tars in place: SOURCE (a folder, a .tar path or 'data/shard-{000..099}.tar', an s3://
    prefix, or an http(s):// pattern 'https://host/data/shard-{000..099}.tar') is read, never written; OUT gets
    dataset.json, each tar's row index and the column index. Rerun to index new tars only; a tar whose bytes
    changed is refused (exit 1). Read it with --source (or Remote(base_url=)) naming the tars' folder or prefix."""
    report = index_tars(source, out, label_member=label_member, label_field=label_field, val_fraction=val_fraction,
                        seed=seed, train_shards=_names(train_shards), val_shards=_names(val_shards),
                        max_bytes=max_bytes, storage_options=s3, quiet=quiet)
    if not quiet:
        click.echo(f"{out}: {report.to_dict()['tars_indexed']} tars indexed, {report.kept} kept, "
                   f"{report.rejected} samples refused; read with --source {report.source_base}", err=True)
    emit_json(report.to_dict())
