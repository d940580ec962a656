"""What every console script shares: exit codes, error-to-message mapping, common options, scheduler defaults.

Only CLI code reads environment variables (Slurm's array variables, a Kubernetes Indexed Job's index); library
functions take explicit configs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Callable

import click

from shards.errors import InputError, ShardcacheError
from shards.cli.exits import settle, settle_on_signal
from shards.jobs.preemption import Preempted
from shards.jobs.progress import setup_logging

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
# Stopped by a signal after saving its place: rerun (with --resume) to continue; 75 is sysexits' EX_TEMPFAIL.
EXIT_PREEMPTED, EXIT_INTERRUPTED = 75, 130
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
    """Turn domain errors into a one-line message and the documented exit code (2 bad input, 1 failure; 75 stopped
    by a signal with the place saved, ``shards.jobs.preemption``)."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            result = func(*args, **kwargs)
        except InputError as exc:
            click.echo(f"error: {error_line(exc)}", err=True)
            settle(EXIT_USAGE)
        except ShardcacheError as exc:
            click.echo(f"error: {error_line(exc)}", err=True)
            settle(EXIT_FAILED)
        except Preempted as exc:
            if exc.line:
                click.echo(exc.line, err=True)
            settle(EXIT_PREEMPTED)
        except KeyboardInterrupt:
            click.echo("error: interrupted", err=True)
            settle(EXIT_INTERRUPTED)
        settle_on_signal()
        return result

    return wrapper


def quiet_option(func: Callable) -> Callable:
    """``--quiet``: no progress bars, warnings and errors only."""

    @click.option("--quiet", "-q", is_flag=True, help="No progress bars; log warnings and errors only.")
    @functools.wraps(func)
    def wrapper(*args, quiet: bool, **kwargs):
        setup_logging(quiet=quiet)
        return func(*args, quiet=quiet, **kwargs)

    return wrapper


# Kubernetes gives an Indexed Job's pods their index but no count: the count comes from --num-tasks or this.
NUM_TASKS_ENV = "SHARDCACHE_NUM_TASKS"


def env_int(name: str, fallback: int | None) -> int | None:
    """An integer environment variable (``fallback`` when unset or empty); anything else is an input error."""
    value = os.environ.get(name)
    if value is None or value == "":
        return fallback
    try:
        return int(value)
    except ValueError:
        raise InputError(f"environment variable {name}={value!r} is not an integer") from None


def _agreed(found: dict[str, int], what: str, option: str) -> int | None:
    """The one value the schedulers' variables give (None: none set); two that disagree are an input error, since
    picking one silently could make two tasks do the same part and none the other."""
    if len(set(found.values())) > 1:
        named = ", ".join(f"{name}={value}" for name, value in found.items())
        raise InputError(f"the {what} is ambiguous ({named}); pass {option}")
    return next(iter(found.values()), None)


def scheduler_task(task_index: int | None, num_tasks: int | None) -> tuple[int, int]:
    """``(task_index, num_tasks)``, or an ``InputError`` when they cannot be told: the options when given, else a
    Slurm job array's variables (``SLURM_ARRAY_TASK_ID`` counted from ``SLURM_ARRAY_TASK_MIN``,
    ``SLURM_ARRAY_TASK_COUNT``), else a Kubernetes Indexed Job's ``JOB_COMPLETION_INDEX`` with the count from
    ``SHARDCACHE_NUM_TASKS``, else task 0 of 1.

    Where both schedulers' variables are set they must agree. A ``JOB_COMPLETION_INDEX`` with no count anywhere is
    refused: each pod would take itself for the only task and do all the work (docs/clusters.md)."""
    if num_tasks is None:
        counts = {name: env_int(name, None) for name in ("SLURM_ARRAY_TASK_COUNT", NUM_TASKS_ENV)}
        num_tasks = _agreed({k: v for k, v in counts.items() if v is not None}, "task count", "--num-tasks")
        if num_tasks is None and task_index is None and env_int("JOB_COMPLETION_INDEX", None) is not None:
            raise InputError(f"JOB_COMPLETION_INDEX is set (a Kubernetes Indexed Job) but not the task count: "
                             f"pass --num-tasks N or set {NUM_TASKS_ENV} to the Job's completions")
    if task_index is None:
        found = {}
        slurm = env_int("SLURM_ARRAY_TASK_ID", None)
        if slurm is not None:
            # Arrays may start at a non-zero index (--array=1-4); count from SLURM_ARRAY_TASK_MIN.
            found["SLURM_ARRAY_TASK_ID"] = slurm - env_int("SLURM_ARRAY_TASK_MIN", 0)
        kubernetes = env_int("JOB_COMPLETION_INDEX", None)
        if kubernetes is not None:
            found["JOB_COMPLETION_INDEX"] = kubernetes
        task_index = _agreed(found, "task index", "--task-index")
    num_tasks, task_index = 1 if num_tasks is None else num_tasks, 0 if task_index is None else task_index
    if num_tasks < 1 or not 0 <= task_index < num_tasks:
        raise InputError(f"task index {task_index} is not in [0, {num_tasks}) (--task-index, --num-tasks)")
    return task_index, num_tasks


def task_options(func: Callable) -> Callable:
    """``--task-index/--num-tasks``, defaulting from a Slurm job array or a Kubernetes Indexed Job
    (``scheduler_task``: the only place their variables are read)."""

    @click.option("--task-index", type=int, default=None,
                  help="This task's index in [0, num-tasks). Default: $SLURM_ARRAY_TASK_ID (from "
                       "$SLURM_ARRAY_TASK_MIN), else $JOB_COMPLETION_INDEX (Kubernetes Indexed Job), else 0.")
    @click.option("--num-tasks", type=int, default=None,
                  help=f"How many tasks split the work. Default: $SLURM_ARRAY_TASK_COUNT, else ${NUM_TASKS_ENV} "
                       "(needed with $JOB_COMPLETION_INDEX), else 1.")
    @functools.wraps(func)
    @handle_errors  # a bad index or count is one line and exit 2, like every other input error
    def wrapper(*args, task_index: int | None, num_tasks: int | None, **kwargs):
        task_index, num_tasks = scheduler_task(task_index, num_tasks)
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
    """The machine-readable result: one JSON line on stdout. The outcome is decided once it is printed: a stop
    signal in the seconds the command still takes to close its loaders ends it with 0 (``settle_on_signal``)."""
    click.echo(json.dumps(result, sort_keys=True, default=str))
    settle_on_signal()


def s3_options(func: Callable) -> Callable:
    """``--s3-endpoint-url``, ``--s3-profile``, ``--s3-unsigned``, ``--s3-max-concurrency``, ``--s3-read-ahead``:
    how to reach ``s3://`` locations; ``--min-transfer-rate``, ``--request-deadline``: how slow an ``s3://`` or
    ``http(s)://`` server may be before a request is cut off. Passed on as ``s3=S3Options(...)``. Unset options
    fall back to botocore's chain (``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``~/.aws/config``); credentials are never
    options (environment, ``~/.aws/credentials`` or the profile)."""

    @click.option("--s3-endpoint-url", default=None, metavar="URL",
                  help="S3-compatible endpoint (MinIO, Ceph, R2, SeaweedFS). Default: $AWS_ENDPOINT_URL or AWS.")
    @click.option("--s3-profile", default=None, help="Profile of ~/.aws/config. Default: $AWS_PROFILE or default.")
    @click.option("--s3-unsigned", is_flag=True, help="Anonymous requests, for public buckets.")
    @click.option("--s3-max-concurrency", type=click.IntRange(1, 64), default=None,
                  help="Ranged requests in flight per process for long reads (parallel parts). Default: 8.")
    @click.option("--s3-read-ahead", type=ByteSize(), default=None,
                  help="Bytes of a reader's coming reads fetched ahead of the one it reads (0: none). Default: 64M.")
    @click.option("--min-transfer-rate", type=ByteSize(), default=None, metavar="BYTES",
                  help="Bytes per second an s3:// or http(s):// server must send, averaged over 30 s of waiting, "
                       "else the request is cut off (0: no minimum). Default: 1K.")
    @click.option("--request-deadline", type=click.FloatRange(0, None, min_open=True), default=None,
                  metavar="SECONDS", help="Seconds one request may wait on an s3:// or http(s):// server in all. "
                                          "Default: 1800.")
    @functools.wraps(func)
    def wrapper(*args, s3_endpoint_url: str | None, s3_profile: str | None, s3_unsigned: bool,
                s3_max_concurrency: int | None, s3_read_ahead: int | None, min_transfer_rate: int | None,
                request_deadline: float | None, **kwargs):
        from shards.transport.s3 import S3Options

        tuned = {name: value for name, value in (("max_concurrency", s3_max_concurrency),
                                                 ("read_ahead_bytes", s3_read_ahead),
                                                 ("min_transfer_rate", min_transfer_rate),
                                                 ("request_deadline_s", request_deadline)) if value is not None}
        options = S3Options(endpoint_url=s3_endpoint_url, profile=s3_profile, unsigned=s3_unsigned, **tuned)
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


# The node cache's tuning options, declared once: ``cache_options`` (train-from-shards, precompute-features) and
# ``shards plan`` (which forecasts the same cache) take them from here, so they read and parse alike.
CACHE_OPTIONS: dict[str, dict[str, Any]] = {
    "--cache-limit": dict(type=ByteSize(), default=None,
                          help="Bytes the cache may hold (e.g. 200G); the shards the readers' epoch plans need "
                               "furthest ahead are evicted first. Default: no limit."),
    "--cache-eviction": dict(type=click.Choice(["next-use", "lru"]), default="next-use", show_default=True,
                             help="Which shard goes when the cache is full: the one the plans read again furthest "
                                  "ahead, or the least recently used."),
    "--cache-prefetch": dict(type=ByteSize(), default=None,
                             help="Bytes of shards fetched ahead along the plan beyond the next one (0: the next "
                                  "only). Default: 256M."),
    "--cache-local": dict(is_flag=True, help="Cache local shard paths too (default: only those on a network file "
                                             "system)."),
}


def cache_option(name: str) -> Callable:
    """One of ``CACHE_OPTIONS`` as a click option."""
    return click.option(name, **CACHE_OPTIONS[name])


def cache_options(func: Callable) -> Callable:
    """``--cache-dir``, ``--cache-limit``, ``--cache-fallback``, ``--cache-local``, ``--cache-eviction``,
    ``--cache-prefetch``: the node-local shard cache
    (``shards.cache.node``), passed on as ``cache=ShardCache(...)``. The folder defaults to
    ``$SHARDCACHE_CACHE_DIR``, else no cache (no surprise disk use)."""

    @click.option("--cache-dir", type=click.Path(path_type=str), default=None,
                  help="Node-local folder that keeps whole shards fetched from s3://, http(s):// or a network "
                       "file system, shared by every rank and worker of the node. Default: $SHARDCACHE_CACHE_DIR, "
                       "else none.")
    @cache_option("--cache-limit")
    @cache_option("--cache-eviction")
    @cache_option("--cache-prefetch")
    @click.option("--cache-fallback", is_flag=True,
                  help="When the cache disk is full, read from the source instead of failing.")
    @cache_option("--cache-local")
    @functools.wraps(func)
    def wrapper(*args, cache_dir: str | None, cache_limit: int | None, cache_fallback: bool, cache_local: bool,
                cache_eviction: str, cache_prefetch: int | None, **kwargs):
        from shards.cache.node import ShardCache

        folder = cache_dir if cache_dir is not None else os.environ.get("SHARDCACHE_CACHE_DIR") or None
        if folder is None and (cache_limit is not None or cache_fallback or cache_local or cache_prefetch is not None
                               or cache_eviction != "next-use"):
            raise click.BadParameter("give --cache-dir (or set SHARDCACHE_CACHE_DIR)", param_hint="--cache-limit")
        tuned = {} if cache_prefetch is None else {"prefetch_bytes": cache_prefetch}
        request = None if folder is None else ShardCache(folder, cache_limit, fallback=cache_fallback,
                                                         local=True if cache_local else None,
                                                         eviction=cache_eviction, **tuned)
        return func(*args, cache=request, **kwargs)

    return wrapper



MEMORY_BUDGET_HELP = ("Bytes the data loader may hold in flight per process (batches queued, in shared memory or "
                      "being filled, samples decoded ahead, remote read-ahead), e.g. 2G; its queues are sized to fit "
                      "and a budget below one batch per worker is refused naming the smallest. Default: a quarter "
                      "of what the job (its cgroup, else the machine) has left, shared by the node's ranks.")


def memory_budget_option(func: Callable) -> Callable:
    """``--memory-budget SIZE``: the loader's memory budget (``shards.loader.budget``), passed on as
    ``memory_budget`` (bytes, or None for the default)."""
    return click.option("--memory-budget", type=ByteSize(), default=None, metavar="SIZE",
                        help=MEMORY_BUDGET_HELP)(func)



def overwrite_option(what: str) -> Callable:
    """``--overwrite``: replace ``what`` (a different run, dataset, feature folder or index) at the output."""
    return click.option("--overwrite", is_flag=True, help=f"Replace {what}.")


def seed_option(what: str, value_type: Any = int) -> Callable:
    """``--seed N`` (default 0): the seed of ``what``, so every random choice a command makes is named."""
    return click.option("--seed", type=value_type, default=0, show_default=True, help=f"Seed of {what}.")


def shard_source_option(where: str = "beside dataset.json", whose: str = "the shards",
                        name: str = "source") -> Callable:
    """``--source PATH``: where an index's tars are (``shards index`` writes the index, not the tars)."""
    return click.option("--source", name, default=None, metavar="PATH",
                        help=f"Where {whose} are when not {where}: the tars of an index made by shards index "
                             "(a folder, s3:// or https:// prefix).")


def staging_options(what: str) -> Callable:
    """``--stage-dir``, ``--break-lease``: how a job writes to ``--out s3://...`` (staged locally, under a lease).
    ``what`` says what is made in the staging folder."""

    def decorate(func: Callable) -> Callable:
        func = click.option("--break-lease", is_flag=True,
                            help="With --out s3://...: take over the prefix's writer lease even while another run "
                                 "holds it (a lease left by a killed run expires by itself 10 minutes after its last "
                                 "renewal).")(func)
        return click.option("--stage-dir", type=click.Path(path_type=str), default=None,
                            help=f"With --out s3://...: the local folder {what} before upload (default: "
                                 "$SHARDCACHE_STAGE_DIR or ~/.cache/shardcache/stage, one folder per URL; required "
                                 "with --num-tasks > 1, on a shared file system).")(func)

    return decorate

# --- The vocabulary every command shares: one default for --workers, one device name rule, --version. ---


def default_workers() -> int:
    """The one default of every command's ``--workers``: the CPUs this process may use minus one (the main process
    keeps one for itself: the training step, the writer, the progress), at most 8; 0 means the work runs in this
    process. One rule, so a user who learnt it on one command knows it on all (docs/troubleshooting.md)."""
    from shards.jobs.parallel import MAX_DEFAULT_WORKERS, usable_cpus

    return max(0, min(MAX_DEFAULT_WORKERS, usable_cpus() - 1))


WORKERS_RULE = "the usable CPUs minus one, at most 8 (0: in this process)"


def workers_option(what: str) -> Callable:
    """``--workers N``: ``what`` the workers are, with the shared default (``default_workers``), resolved here so
    the command receives a count."""

    def decorate(func: Callable) -> Callable:
        @click.option("--workers", type=click.IntRange(0, 256), default=None, metavar="N",
                      help=f"{what}. Default: {WORKERS_RULE}.")
        @functools.wraps(func)
        def wrapper(*args, workers: int | None, **kwargs):
            return func(*args, workers=default_workers() if workers is None else workers, **kwargs)

        return wrapper

    return decorate


class DeviceName(click.ParamType):
    """``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``, checked by the one rule
    (``shards.jobs.device_names``) that the library's configs check too."""

    name = "auto|cpu|cuda|cuda:N"

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return self.name  # as written, not upper-cased

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        from shards.jobs.device_names import check_device_name

        try:
            return check_device_name(value, "--device")
        except InputError as exc:
            self.fail(str(exc), param, ctx)


DEVICE_HELP = "auto (CUDA when present), cpu, cuda or cuda:N."


def device_option(more: str = "") -> Callable:
    """``--device``: ``auto`` by default, checked by ``DeviceName``; ``more`` says what the command does with it."""
    return click.option("--device", type=DeviceName(), default="auto", show_default=True,
                        help=f"{DEVICE_HELP} {more}".strip())


def version_option(func: Callable) -> Callable:
    """``--version``: the installed shardcache version, the same on every command."""
    from shards import __version__

    return click.version_option(__version__, "--version", message="%(prog)s (shardcache) %(version)s")(func)


# The options ``s3_options`` adds, for a command's --help sections (one list, not one per command).
S3_OPTION_NAMES = ("s3_endpoint_url", "s3_profile", "s3_unsigned", "s3_max_concurrency", "s3_read_ahead",
                   "min_transfer_rate", "request_deadline")
