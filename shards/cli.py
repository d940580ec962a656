"""The ``shards`` console script: verify and inspect shard folders."""

from __future__ import annotations

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Verify and inspect shardcache folders."""
