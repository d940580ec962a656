"""The storage knobs of the CLIs (``shards.cli.common``): ``--s3-max-concurrency``/``--s3-read-ahead`` become
``S3Options`` fields, ``--cache-eviction``/``--cache-prefetch`` ``ShardCache`` fields; bad values are usage errors."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from shards.cli.common import cache_options, s3_options


@click.command()
@s3_options
@cache_options
def show(s3, cache) -> None:
    click.echo(json.dumps({"s3": s3.to_dict(), "cache": None if cache is None else
                           {"eviction": cache.eviction, "prefetch_bytes": cache.prefetch_bytes, "limit": cache.limit}}))


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(show, list(args), env={"SHARDCACHE_CACHE_DIR": "", **(env or {})})


def test_the_knobs_reach_the_options(tmp_path):
    result = run("--s3-max-concurrency", "3", "--s3-read-ahead", "16M", "--cache-dir", str(tmp_path),
                 "--cache-limit", "1G", "--cache-eviction", "lru", "--cache-prefetch", "0")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["s3"]["max_concurrency"] == 3 and shown["s3"]["read_ahead_bytes"] == 16 << 20
    assert shown["cache"] == {"eviction": "lru", "prefetch_bytes": 0, "limit": 1 << 30}


def test_defaults_are_the_libraries():
    from shards.cache.node import ShardCache
    from shards.transport.s3 import S3Options

    shown = json.loads(run().output)
    assert shown["s3"] == S3Options().to_dict() and shown["cache"] is None
    assert ShardCache("x").eviction == "next-use"


@pytest.mark.parametrize("args", [("--s3-max-concurrency", "0"), ("--s3-max-concurrency", "65"),
                                  ("--s3-read-ahead", "lots"), ("--cache-eviction", "random"),
                                  ("--cache-eviction", "lru"), ("--cache-prefetch", "1M")])
def test_bad_or_orphan_values_are_usage_errors(args):
    result = run(*args)  # the last two: cache settings without a cache folder
    assert result.exit_code == 2 and "Error" in result.output
