"""What every console script shares: exit codes, error-to-message mapping, common options, Slurm defaults.

Only CLI code reads environment variables (Slurm's array variables); library functions take explicit configs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from typing import Any, Callable

import click

from shards.errors import InputError, ShardcacheError
from shards.progress import setup_logging

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
log = logging.getLogger("shardcache")


def error_line(exc: BaseException) -> str:
    """The one line to print for a domain error, also when a DataLoader worker raised it.

    torch re-raises a worker's exception as ``type(exc)("Caught X in DataLoader worker process N.\nOriginal
    Traceback ...\nshards.errors.X: <message>")``: the message that matters is that last line, without its type.
    """
    text = str(exc)
    if "\nOriginal Traceback" in text:
        lines = [line for line in text.splitlines() if line.strip()]
        qualified = f"{type(exc).__module__}.{type(exc).__qualname__}: "
        text = next((line[len(qualified):] for line in reversed(lines) if line.startswith(qualified)), lines[-1])
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def handle_errors(func: Callable) -> Callable:
    """Turn domain errors into a one-line message and the documented exit code (2 bad input, 1 failure)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except InputError as exc:
            click.echo(f"error: {error_line(exc)}", err=True)
            sys.exit(EXIT_USAGE)
        except ShardcacheError as exc:
            click.echo(f"error: {error_line(exc)}", err=True)
            sys.exit(EXIT_FAILED)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            sys.exit(130)

    return wrapper


def quiet_option(func: Callable) -> Callable:
    """``--quiet``: no progress bars, warnings and errors only."""

    @click.option("--quiet", "-q", is_flag=True, help="No progress bars; log warnings and errors only.")
    @functools.wraps(func)
    def wrapper(*args, quiet: bool, **kwargs):
        setup_logging(quiet=quiet)
        return func(*args, quiet=quiet, **kwargs)

    return wrapper


def slurm_task_default(name: str, fallback: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return fallback
    try:
        return int(value)
    except ValueError:
        raise click.UsageError(f"environment variable {name}={value!r} is not an integer") from None


def task_options(func: Callable) -> Callable:
    """``--task-index/--num-tasks``, defaulting from a Slurm job array (the only place Slurm variables are read)."""

    @click.option("--task-index", type=int, default=None,
                  help="This task's index in [0, num-tasks). Default: $SLURM_ARRAY_TASK_ID or 0.")
    @click.option("--num-tasks", type=int, default=None,
                  help="How many tasks split the work. Default: $SLURM_ARRAY_TASK_COUNT or 1.")
    @functools.wraps(func)
    def wrapper(*args, task_index: int | None, num_tasks: int | None, **kwargs):
        if num_tasks is None:
            num_tasks = slurm_task_default("SLURM_ARRAY_TASK_COUNT", 1)
        if task_index is None:
            task_index = slurm_task_default("SLURM_ARRAY_TASK_ID", 0)
            # Arrays may start at a non-zero index (--array=1-4); count from SLURM_ARRAY_TASK_MIN.
            task_index -= slurm_task_default("SLURM_ARRAY_TASK_MIN", 0)
        if num_tasks < 1 or not 0 <= task_index < num_tasks:
            raise click.BadParameter(f"task index {task_index} is not in [0, {num_tasks})", param_hint="--task-index")
        return func(*args, task_index=task_index, num_tasks=num_tasks, **kwargs)

    return wrapper


def class_names(text: str | None, option: str = "--classes") -> list[str] | None:
    """``"cat, dog"`` -> ``["cat", "dog"]`` (None when the option was not given); an empty list is a usage error."""
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise click.BadParameter("name at least one class", param_hint=option)
    return names


def emit_json(result: Any) -> None:
    """The machine-readable result: one JSON line on stdout."""
    click.echo(json.dumps(result, sort_keys=True, default=str))


def s3_options(func: Callable) -> Callable:
    """``--s3-endpoint-url``, ``--s3-profile``, ``--s3-unsigned``: how to reach ``s3://`` locations, passed on as
    ``s3=S3Options(...)``. Unset options fall back to botocore's chain (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``,
    ``~/.aws/config``); credentials are never options (environment, ``~/.aws/credentials`` or the profile)."""

    @click.option("--s3-endpoint-url", default=None, metavar="URL",
                  help="S3-compatible endpoint (MinIO, Ceph, R2, SeaweedFS). Default: $AWS_ENDPOINT_URL or AWS.")
    @click.option("--s3-profile", default=None, help="Profile of ~/.aws/config. Default: $AWS_PROFILE or default.")
    @click.option("--s3-unsigned", is_flag=True, help="Anonymous requests, for public buckets.")
    @functools.wraps(func)
    def wrapper(*args, s3_endpoint_url: str | None, s3_profile: str | None, s3_unsigned: bool, **kwargs):
        from shards.formats.s3 import S3Options

        options = S3Options(endpoint_url=s3_endpoint_url, profile=s3_profile, unsigned=s3_unsigned)
        return func(*args, s3=options, **kwargs)

    return wrapper


class ByteSize(click.ParamType):
    """``268435456``, ``256M``, ``256MiB`` or ``1G`` (binary units; ``shards.units.parse_size``)."""

    name = "bytes"

    def convert(self, value, param, ctx) -> int:
        from shards.units import parse_size

        try:
            return parse_size(value)
        except InputError:
            self.fail(f"{value!r} is not a size like 268435456, 256M or 1G", param, ctx)


def cache_options(func: Callable) -> Callable:
    """``--cache-dir``, ``--cache-limit``, ``--cache-fallback``, ``--cache-local``: the node-local shard cache
    (``shards.cache.node``), passed on as ``cache=ShardCache(...)``. The folder defaults to
    ``$SHARDCACHE_CACHE_DIR``, else no cache (no surprise disk use)."""

    @click.option("--cache-dir", type=click.Path(path_type=str), default=None,
                  help="Node-local folder that keeps whole shards fetched from s3://, http(s):// or a network "
                       "file system, shared by every rank and worker of the node. Default: $SHARDCACHE_CACHE_DIR, "
                       "else none.")
    @click.option("--cache-limit", type=ByteSize(), default=None,
                  help="Bytes the cache may hold (e.g. 200G); least recently used shards are evicted. "
                       "Default: no limit.")
    @click.option("--cache-fallback", is_flag=True,
                  help="When the cache disk is full, read from the source instead of failing.")
    @click.option("--cache-local", is_flag=True,
                  help="Cache local shard paths too (default: only those on a network file system).")
    @functools.wraps(func)
    def wrapper(*args, cache_dir: str | None, cache_limit: int | None, cache_fallback: bool, cache_local: bool,
                **kwargs):
        from shards.cache.node import ShardCache

        folder = cache_dir if cache_dir is not None else os.environ.get("SHARDCACHE_CACHE_DIR") or None
        if folder is None and (cache_limit is not None or cache_fallback or cache_local):
            raise click.BadParameter("give --cache-dir (or set SHARDCACHE_CACHE_DIR)", param_hint="--cache-limit")
        request = None if folder is None else ShardCache(folder, cache_limit, fallback=cache_fallback,
                                                         local=True if cache_local else None)
        return func(*args, cache=request, **kwargs)

    return wrapper
