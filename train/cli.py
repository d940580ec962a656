"""The ``train-from-shards`` console script."""

from __future__ import annotations

import sys

import click

from shards.cli_common import EXIT_USAGE


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
def train_command() -> None:
    """Train from image or feature shards (coming in the training issue)."""
    click.echo("train-from-shards: not built yet", err=True)
    sys.exit(EXIT_USAGE)
