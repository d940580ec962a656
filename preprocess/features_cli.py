"""The ``precompute-features`` console script."""

from __future__ import annotations

import sys

import click

from shards.cli_common import EXIT_USAGE


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
def precompute_features_command() -> None:
    """Compute a frozen backbone's penultimate features per shard (coming in the features issue)."""
    click.echo("precompute-features: not built yet", err=True)
    sys.exit(EXIT_USAGE)
