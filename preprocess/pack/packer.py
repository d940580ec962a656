"""``pack`` (``pack_manifest``): source files in, validated, shuffled, sequential shards and ``dataset.json`` out.

The job is planned first (a pure function of the source and options, see ``preprocess.pack.plan``), then each shard is
packed independently, by one of ``--workers`` processes and one of ``--num-tasks`` Slurm tasks, into a temp file
that is fsynced and renamed, followed by its part manifest. ``dataset.json`` is written last, by whichever task
finds every part present (or by ``merge_parts``), so a folder with a ``dataset.json`` is always complete.

Every run holds the writer locks of ``OUT/.pack/`` (``shards.lock.claim_output``): the tasks of one job share the
folder, a second run of the same task (or a run while ``--append``/``--merge`` holds the folder) exits with code 2,
and the last tasks to finish merge one at a time.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from preprocess.pack.merge import merge_parts
from preprocess.pack.parts import (STATE_DIR, check_output, load_part, missing_parts, part_path, prepare_output,
                                   read_plan_doc, shard_files, write_part)
from preprocess.pack.sources.members import DEFAULT_MAX_BYTES, MemberBytes, MemberSpec, SourceFields
from preprocess.pack.sources.registry import fetch_members
from preprocess.pack.plan import PackPlan, PlannedShard, make_plan
from preprocess.pack.sources.scan import SourceScan, check_out_outside_source, scan_source
from preprocess.pack.source_diff import describe_change
from shards.errors import redact
from shards.atomic import check_local_output, check_room, on_disk_full, remove_stale_tmp
from preprocess.pack.validate import (InvalidImage, ValidateOptions, read_ahead, read_and_validate, sample_meta,
                                      validate_image)
from shards.image.decode import DEFAULT_MAX_PIXELS
from shards.errors import CorruptDataError, InputError
from shards.manifest import DATASET_FILE, DatasetManifest, load_dataset_manifest
from shards.jobs.progress import progress
from shards.formats.sample import RawSample
from shards.transport.storage import STORAGES, writable_storage
from shards.lock import claim_output, merge_lock
from shards.jobs.parallel import ordered_map

log = logging.getLogger("shardcache.pack")
SHOWN_SKIPPED = 3  # paths named in the one warning line about skipped files


@dataclass(frozen=True)
class PackConfig:
    """Every option of ``pack-shards``; those that shape the output bytes are recorded in ``dataset.json``."""

    source: str
    out: str
    storage: str = "tar"
    max_samples: int = 1000
    max_bytes: int = DEFAULT_MAX_BYTES
    val_fraction: float = 0.0
    seed: int = 0
    shuffle: bool = True
    verify: str = "full"
    max_pixels: int = DEFAULT_MAX_PIXELS
    resize_max_side: int | None = None
    quality: int | None = None
    strict: bool = False
    allow_empty_classes: bool = False
    workers: int = 1
    task_index: int = 0
    num_tasks: int = 1
    overwrite: bool = False
    quiet: bool = False
    source_fields: SourceFields = SourceFields()  # where a Parquet/Arrow/WebDataset source keeps image and label
    validate: ValidateOptions = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_local_output(self.out)
        check_out_outside_source(self.source, self.out)
        writable_storage(self.storage)
        for name in ("max_samples", "max_bytes", "workers", "num_tasks"):
            if getattr(self, name) < 1:
                raise InputError(f"{name}={getattr(self, name)}: must be at least 1")
        if not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"val_fraction={self.val_fraction}: must be in [0, 1)")
        if not 0 <= self.task_index < self.num_tasks:
            raise InputError(f"task_index={self.task_index}: must be in [0, num_tasks={self.num_tasks})")
        object.__setattr__(self, "validate", ValidateOptions(self.verify, self.max_pixels, self.resize_max_side,
                                                             self.quality, max_file_bytes=self.max_bytes))

    def packing(self) -> dict[str, Any]:
        """The options that decide the output (task split, workers and verbosity do not)."""
        reencode = None
        if self.validate.reencode:
            reencode = {"format": "jpg", "max_side": self.resize_max_side, "quality": self.quality or 90}
        return {"seed": self.seed, "shuffle": self.shuffle, "val_fraction": self.val_fraction,
                "max_samples": self.max_samples, "max_bytes": self.max_bytes, "verify": self.verify,
                "max_pixels": self.max_pixels, "reencode": reencode}


@dataclass(frozen=True)
class PackResult:
    manifest: DatasetManifest | None  # None while other tasks' shards are still missing
    summary: dict[str, Any]


class ShardJob(NamedTuple):
    """What a worker process needs to pack one shard (picklable)."""

    out: str
    shard: PlannedShard
    classes: tuple[str, ...]
    storage: str
    validate: ValidateOptions
    strict: bool
    plan_sha256: str
    # The parent's copy of the part leaves out its per-sample index rows (the part file on disk holds them): a
    # pack of N files must not hold N rows in the parent. ``--append`` still takes them back (False).
    summary_only: bool = False
    members: MemberSpec | None = None  # samples are members of container files (``preprocess.pack.sources.members``)


def _pack_sample(job: ShardJob, sample, skipped: list[dict], index: list[dict], position: int,
                 member: MemberBytes | None = None) -> RawSample | None:
    """The sample to write at ``position`` of the shard (its row in the source index says so: a subset selects
    rows by it without reading the shard), or None when it is skipped. ``member``: what a container held for it
    (None: the sample is the file at its path)."""
    row = {"key": sample.key, "path": sample.rel_path, "size": sample.size, "mtime_ns": sample.mtime_ns,
           "label": sample.label, "split": job.shard.split, "shard": None}
    try:
        if member is None:
            image = read_and_validate(sample.abs_path, job.validate)
        elif member.data is None:
            raise InvalidImage(member.problem)
        else:
            image = validate_image(member.data, job.validate)
    except InvalidImage as exc:
        if job.strict:
            raise CorruptDataError(f"{exc} (--strict)", path=sample.abs_path) from None
        skipped.append({"path": sample.rel_path, "reason": str(exc)})
        index.append({**row, "skipped": str(exc)})
        return None
    fields, meta = sample_meta(sample.rel_path, job.classes[sample.label], image,
                               member.meta if member is not None else None)
    # The ``<key>.json`` member's fields (width, height...) in the index too, so a reader can filter on them
    # without opening a shard; the very values the member's bytes encode, so the two never disagree.
    index.append({**row, "shard": job.shard.name, "row": position, "meta": fields})
    return RawSample(sample.key, image.data, image.ext, sample.label, meta, member.extra if member else ())


def pack_shard(job: ShardJob, on_file: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Validate and write one shard, then its part manifest; returns the part (without its ``index`` rows under
    ``job.summary_only``). No shard file for an all-skipped shard."""
    out = Path(job.out)
    counts = [0] * len(job.classes)
    skipped: list[dict] = []
    index: list[dict] = []
    writer, payload = None, 0
    samples = list(job.shard.samples)
    with ExitStack() as stack:
        if job.members is None:
            stack.enter_context(read_ahead([sample.abs_path for sample in samples], job.validate.max_file_bytes))
            members: Sequence[MemberBytes | None] = [None] * len(samples)
        else:  # every container of the shard opened once, its members read in order
            members = fetch_members(job.members, samples)
        for sample, member in zip(samples, members):
            raw = _pack_sample(job, sample, skipped, index, writer.samples if writer is not None else 0, member)
            if raw is not None:
                if writer is None:
                    spec = STORAGES[job.storage]
                    writer = stack.enter_context(spec.writer(out / job.shard.name, classes=job.classes))
                writer.write(raw)
                counts[raw.label] += 1
                payload += len(raw.data) + len(raw.meta) + len(raw.key) + 32
            if on_file is not None:
                on_file(sample.size)
        if writer is not None and job.storage == "hdf5":
            # Written whole as the writer closes, and HDF5 crashes on a disk that fills up under it: ask first.
            check_room(out, payload, job.shard.name)
    info = None
    if writer is not None:
        info = {"path": job.shard.name, "samples": writer.samples, "bytes": writer.bytes, "sha256": writer.sha256}
        if getattr(writer, "index", None) is not None:  # tar shards: the per-sample byte index beside the shard
            info.update(index=writer.index, index_sha256=writer.index_sha256)
        info["class_counts"] = counts  # in the shard's ShardInfo, so a class subset can skip shards unread
    part = {"plan_sha256": job.plan_sha256, "split": job.shard.split, "shard": info, "class_counts": counts,
            "skipped": skipped, "index": index, "source_files": len(job.shard.samples),
            "source_bytes": sum(s.size for s in samples)}
    write_part(out, job.shard.name, part)
    return {k: v for k, v in part.items() if k != "index"} if job.summary_only else part


def _plan_doc(plan: PackPlan, storage: str) -> dict[str, Any]:
    scan = plan.scan
    return {"plan_sha256": plan.sha256, "storage": storage, "classes": list(scan.classes),
            "source": {"kind": scan.kind, "root": redact(scan.root), "files_seen": scan.files_seen,
                       "skipped": [{"path": s.rel_path, "reason": s.reason} for s in scan.skipped]},
            "packing": plan.packing, "splits": plan.splits,
            "shards": [{"name": s.name, "split": s.split} for s in plan.shards]}


class PackMeter:
    """The progress bar: files/s from tqdm, MB/s of source bytes as a postfix."""

    def __init__(self, total_files: int, quiet: bool):
        self.bar = progress(total=total_files, desc="pack", unit="file", quiet=quiet)
        self.start = time.monotonic()
        self.bytes = 0

    def add(self, files: int, nbytes: int) -> None:
        self.bytes += nbytes
        self.bar.update(files)
        elapsed = max(time.monotonic() - self.start, 1e-6)
        self.bar.set_postfix_str(f"{self.bytes / elapsed / 1e6:.1f} MB/s", refresh=False)


def run_jobs(jobs: Sequence[ShardJob], workers: int, meter: PackMeter) -> list[dict[str, Any]]:
    """Pack every job: here, file by file on the meter, or in worker processes (``shards.jobs.parallel``), a shard at a
    time on the meter; the parts come back in job order either way."""
    if workers == 1 or len(jobs) <= 1:
        return [pack_shard(job, on_file=lambda nbytes: meter.add(1, nbytes)) for job in jobs]
    return list(ordered_map(pack_shard, jobs, workers,
                            on_done=lambda part: meter.add(part["source_files"], part["source_bytes"])))


def _finish(out: Path, plan: PackPlan, wrote: int) -> DatasetManifest | None:
    """Merge when every part exists; keep an identical finished manifest untouched when nothing changed."""
    if missing_parts(out, read_plan_doc(out)):
        return None
    with merge_lock(out, STATE_DIR, what="pack-shards merge"):
        if wrote == 0 and (out / DATASET_FILE).is_file():
            existing = load_dataset_manifest(out)
            if existing.packing.get("plan_sha256") == plan.sha256:
                return existing
        return merge_parts(out)


def empty_classes_note(manifest: DatasetManifest) -> str:
    """The classes no sample was packed for, every file of theirs skipped, for the skipped files' warning ("" when
    none; a folder with no image file at all is refused by the scan instead). The dataset keeps them, as
    ``--allow-empty-classes`` would, so class numbers do not shift; a model trained on it never sees them."""
    counts = [sum(split.class_counts[i] for split in manifest.splits.values()) for i in range(len(manifest.classes))]
    empty = [name for name, count in zip(manifest.classes, counts) if count == 0]
    if not empty:
        return ""
    return (f"; {len(empty)} class(es) got no sample at all: {', '.join(map(repr, empty[:5]))}"
            f"{', ...' if len(empty) > 5 else ''} (--allow-empty-classes: expected)")


def skip_kind(reason: str) -> str:
    """What a skip reason says before its particulars: ``too large: 9000x9000 = ...`` -> ``too large``."""
    return re.split(r":| \(", reason, maxsplit=1)[0].strip() or reason


def log_skipped(skipped: Sequence[tuple[str, str]], files_seen: int, also: str = "") -> None:
    """One warning line for the files left out (``(path, reason)``): how many, by reason, and the first few
    paths; ``dataset.json``'s ``source.skipped`` lists them all; ``also``: what else the line says (classes left
    empty). Nothing when none were."""
    if not skipped:
        return
    kinds = Counter(skip_kind(reason) for _, reason in skipped)
    paths = [path for path, _ in skipped[:SHOWN_SKIPPED]] + (["..."] if len(skipped) > SHOWN_SKIPPED else [])
    log.warning("skipped %d of %d source files: %s (%s); dataset.json lists them all in source.skipped%s",
                len(skipped), files_seen, ", ".join(f"{n} {kind}" for kind, n in kinds.most_common()),
                ", ".join(paths), also)


def check_strict(scan: SourceScan, strict: bool) -> None:
    """Under ``--strict`` a file the scan had to skip fails the run (exit 1, like a broken image), before any write."""
    if strict and scan.skipped:
        first = scan.skipped[0]
        raise CorruptDataError(f"{first.reason} (--strict; {len(scan.skipped)} such file(s))",
                               path=str(Path(scan.samples.base) / first.rel_path))


def source_packing(cfg: PackConfig, scan: SourceScan) -> dict[str, Any]:
    """``cfg.packing()`` and, for a container source, where its images and labels were read from (which decides
    the bytes, so it is in the plan digest, and ``--append`` reads new rows the same way)."""
    packing = cfg.packing()
    if scan.members is not None:
        packing.update(members=scan.members.to_dict(), source_fields=dataclasses.asdict(cfg.source_fields))
    return packing


def warn_dropped_members(scan: SourceScan, storage: str) -> None:
    """HDF5 shards hold an image and a label per sample: the other members a kind's samples carry (a WebDataset
    sample's .txt, its own .json...) are not kept."""
    if scan.source_kind.extra_members and storage != "tar":
        log.warning("--storage %s keeps each sample's image and label only; the other members of the %s "
                    "samples (.txt, their own .json...) are kept by --storage tar", storage, scan.source_kind.title)


def pack(cfg: PackConfig) -> PackResult:
    """Pack this task's share of the shards (resuming what is finished) and merge if all parts are there."""
    started = time.monotonic()
    scan = scan_source(cfg.source, allow_empty_classes=cfg.allow_empty_classes, fields=cfg.source_fields,
                       max_bytes=cfg.max_bytes)
    check_strict(scan, cfg.strict)
    warn_dropped_members(scan, cfg.storage)
    plan = make_plan(scan, source_packing(cfg, scan), cfg.storage)
    out = Path(cfg.out)
    plan_doc = _plan_doc(plan, cfg.storage)
    check_output(out, plan_doc, cfg.overwrite,  # refuse before creating even a lock file, saying what changed
                 explain=lambda: describe_change(out, scan, source_packing(cfg, scan)))
    with claim_output(out, STATE_DIR, what="pack-shards", task=(cfg.task_index, cfg.num_tasks),
                      prepare=lambda folder_lock: prepare_output(out, plan_doc, cfg.overwrite, folder_lock)):
        return _pack_claimed(cfg, plan, out, started)


def _pack_claimed(cfg: PackConfig, plan: PackPlan, out: Path, started: float) -> PackResult:
    scan = plan.scan
    mine = [s for i, s in enumerate(plan.shards) if i % cfg.num_tasks == cfg.task_index]
    todo = [s for s in mine if load_part(out, s.name, plan.sha256, check_sha256=True) is None]
    log.info("%d files, %d classes -> %d shards; task %d/%d packs %d (%d already done)", scan.files_seen,
             len(scan.classes), len(plan.shards), cfg.task_index, cfg.num_tasks, len(todo), len(mine) - len(todo))
    jobs = [ShardJob(str(out), s, scan.classes, cfg.storage, cfg.validate, cfg.strict, plan.sha256,
                     summary_only=True, members=scan.members) for s in todo]
    meter = PackMeter(sum(len(s.samples) for s in todo), cfg.quiet)
    try:
        with on_disk_full(out):  # the space left as the disk filled up, before the cleanup below frees some
            packed = run_jobs(jobs, cfg.workers, meter)
    except BaseException:
        # A shard writer that failed while closing (a full disk fails the close too) leaves its temp file until
        # the writer is collected: this task's own temps go now (its names, under its lock), so a failed run
        # leaves a full disk no fuller. Finished shards and parts stay for the rerun.
        remove_stale_tmp(out, set(shard_files(s.name for s in todo)))
        remove_stale_tmp(out / STATE_DIR, {part_path(out, s.name).name for s in todo})
        raise
    finally:
        meter.bar.close()
    manifest = _finish(out, plan, len(todo))
    summary = _summary(cfg, plan, manifest, mine, todo, packed, time.monotonic() - started)
    if manifest is not None:  # the whole dataset's
        log_skipped([(s.path, s.reason) for s in manifest.source.skipped], manifest.source.files_seen,
                    also="" if cfg.allow_empty_classes else empty_classes_note(manifest))
    else:  # what the scan refused and what this task's shards left out
        log_skipped([(s.rel_path, s.reason) for s in scan.skipped]
                    + [(s["path"], s["reason"]) for part in packed for s in part["skipped"]],
                    len(scan.skipped) + sum(part["source_files"] for part in packed))
    return PackResult(manifest, summary)


def _summary(cfg: PackConfig, plan: PackPlan, manifest: DatasetManifest | None, mine: Sequence[PlannedShard],
             todo: Sequence[PlannedShard], packed: Sequence[Mapping[str, Any]], seconds: float) -> dict[str, Any]:
    """What the run did, counted as it is on disk: ``shards_written`` and ``shards_reused`` are shard files (this
    run's, and this task's kept from before), so a planned shard whose every file was skipped is neither;
    ``shards``, ``samples`` and ``bytes`` are the manifest's (the whole dataset's) when it is complete, else this
    task's."""
    written = sum(part["shard"] is not None for part in packed)
    summary: dict[str, Any] = {"out": str(cfg.out), "complete": manifest is not None, "task_index": cfg.task_index,
                               "num_tasks": cfg.num_tasks, "shards_written": written, "seconds": round(seconds, 3),
                               "files_seen": plan.scan.files_seen}
    if manifest is not None:
        shards = [s for split in manifest.splits.values() for s in split.shards]
        kept = {s.name for s in mine} - {s.name for s in todo}
        summary.update(samples=sum(s.samples for s in shards), shards=len(shards),
                       shards_reused=sum(s.path in kept for s in shards),
                       bytes=sum(s.bytes for s in shards), skipped=len(manifest.source.skipped),
                       splits={name: split.samples for name, split in manifest.splits.items()})
    else:  # one part at a time: a part holds its shard's per-sample index rows
        totals: Counter = Counter()
        for shard in mine:
            part = load_part(Path(cfg.out), shard.name, plan.sha256, check_sha256=False)
            if part is not None:
                totals["skipped"] += len(part["skipped"])
                if part["shard"] is not None:
                    totals.update(samples=part["shard"]["samples"], shards=1, bytes=part["shard"]["bytes"])
        summary.update(samples=totals["samples"], shards=totals["shards"], shards_reused=totals["shards"] - written,
                       bytes=totals["bytes"], skipped=totals["skipped"])
    return summary


def pack_manifest(cfg: PackConfig) -> DatasetManifest | None:
    """The library entry point: returns the manifest, or None when other tasks still have shards to pack."""
    return pack(cfg).manifest
