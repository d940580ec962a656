"""Console scripts of the preprocess stage (thin click shells over library functions)."""

from __future__ import annotations

import sys

import click

from shards.cli_common import EXIT_USAGE


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
def pack_shards_command() -> None:
    """Pack an ImageFolder tree or a CSV/JSONL manifest into shards (coming in the pack-shards issue)."""
    click.echo("pack-shards: not built yet", err=True)
    sys.exit(EXIT_USAGE)


from preprocess.features_cli import precompute_features_command  # noqa: E402  (its own module: big option set)
