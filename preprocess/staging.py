"""Writing a batch job's output to object storage: build it in a local staging folder, then publish it.

``pack-shards --out s3://...`` and ``precompute-features --out s3://...`` run exactly as for a local folder, into
``stage_dir`` (by default a persistent folder per URL, so a rerun on the same node resumes the local work too),
and when the job is complete (``dataset.json``/``features.json`` written) upload it with
``shards.publish.s3_upload.publish_folder``: missing or changed objects only, the manifest last, under the
writers' lease on the prefix (``shards.publish.s3_lease``). The tasks of a Slurm array share one explicit
``--stage-dir`` on a shared file system; the task that completes the job uploads. ``preflight`` refuses a prefix
whose lease another writer holds before any local work (the lease itself is taken only to upload).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shards.atomic import on_disk_full
from shards.errors import InputError
from shards.transport.s3 import S3Options, is_s3, make_client
from shards.publish.s3_lease import read_lease, refuse_if_held
from shards.publish.s3_upload import (PublishSpec, check_out_url, default_stage_dir, list_prefix, publish_folder,
                                      refuse_foreign)


@dataclass(frozen=True)
class StagedOutput:
    """Where an ``s3://`` output is built before it is uploaded."""

    url: str
    stage_dir: Path
    options: S3Options
    overwrite: bool = False
    break_lease: bool = False


def resolve_stage(url: str, stage_dir: str | os.PathLike | None, stage_root: str | os.PathLike, *, num_tasks: int,
                  options: S3Options, overwrite: bool, break_lease: bool = False) -> StagedOutput:
    """Check the URL and pick the staging folder; several tasks must name a shared one."""
    check_out_url(url)
    if stage_dir is None and num_tasks > 1:
        raise InputError(f"--out {url}: with --num-tasks {num_tasks} every task must stage in the same folder; "
                         "pass --stage-dir on a shared file system")
    stage = Path(stage_dir) if stage_dir is not None else default_stage_dir(url, stage_root)
    return StagedOutput(url, stage, options, overwrite, break_lease)


def run_staged(staged: StagedOutput, run: Callable[[Path], tuple[Any, dict[str, Any]]],
               spec: PublishSpec) -> tuple[Any, dict[str, Any]]:
    """``run(stage_dir)`` (the local job: returns its manifest, or None while other tasks are missing, and its
    summary), then, when complete, publish the stage to the URL. The summary gains ``out``, ``stage_dir``,
    ``upload``."""
    preflight(staged, spec)  # no credentials, no bucket, foreign objects, a live lease: refused before local work
    with on_disk_full(staged.stage_dir):  # a full stage disk: one line naming it, as for a local --out
        manifest, summary = run(staged.stage_dir)
    summary = {**summary, "out": staged.url, "stage_dir": str(staged.stage_dir)}
    if manifest is None:
        return None, {**summary, "upload": None}
    stats = publish_folder(staged.stage_dir, staged.url, spec, options=staged.options, overwrite=staged.overwrite,
                           break_lease=staged.break_lease)
    return manifest, {**summary, "upload": stats.to_dict()}


def preflight(staged: StagedOutput, spec: PublishSpec) -> None:
    """List the prefix once: the credentials and bucket work, it holds nothing foreign (unless overwrite), and
    no other writer holds a live lease on it (unless break_lease)."""
    bucket, prefix = check_out_url(staged.url)
    client = make_client(staged.options)
    refuse_foreign(list_prefix(f"s3://{bucket}/{prefix}", staged.options), spec, staged.url,
                   overwrite=staged.overwrite)
    refuse_if_held(read_lease(client, staged.url), staged.url, break_lease=staged.break_lease)


__all__ = ["StagedOutput", "is_s3", "resolve_stage", "run_staged"]
