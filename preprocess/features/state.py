"""The resume state of a feature folder, and the assembly of ``features.json`` from it.

``FEAT_DIR/.precompute/config.json`` records what the folder is computing (the hashed config, the dataset folder);
``FEAT_DIR/.precompute/<shard>.json`` is written after its feature file is renamed into place and records that
file's ``ShardInfo``. A shard counts as finished only when its record, the config hash, the source shard's
checksum and the feature file's own checksum all agree, so a killed run (a ``.tmp`` left, a record missing) is
simply completed by the next run, and parallel tasks never write the same file. ``features.json`` is assembled
from the records last, atomically, and only when every shard has one. The writer locks live in
``FEAT_DIR/.precompute/lock*`` (``shards.lock``) and survive ``--overwrite``, which deletes only what the old
``features.json`` and the records name (``recorded_names``, ``shards.jobs.owned``), never a file that merely looks like
a feature shard.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from preprocess.features.feature_stats import check_features
from preprocess.features.loader import ShardJob
from shards.atomic import sha256_file, write_json_atomic, write_json_shared
from shards.door.bounded_read import read_json_file
from shards.check.freshness import shard_staleness
from shards.errors import ManifestError, OutputExistsError, ShardcacheError
from shards.lock import FolderLock, merge_lock
from shards.formats.feature_names import FEATURE_SUFFIXES, is_feature_file
from shards.formats.features import feature_shard_name
from shards.door.locations import check_dataset_dir
from shards.feature_stats import STATS_KEY
from shards.manifest import (FEATURES_FILE, MAX_FEATURES_DIM, MAX_VIEWS, DatasetManifest, FeatureManifest,
                             ShardInfo, SplitInfo, load_feature_manifest)
from shards.jobs.owned import plain_names, refuse_clobber, remove_owned
from shards.publish.s3_upload import PublishSpec
from shards.door.shape import as_int, as_list, as_object, as_str, field as get

log = logging.getLogger(__name__)

STATE_DIR = ".precompute"
CONFIG_RECORD = "config.json"


def config_hash(config: Mapping[str, Any]) -> str:
    """Digest of everything that changes the numbers; canonical JSON, so key order never matters."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def read_config_record(out_dir: Path) -> dict[str, Any] | None:
    """The folder's ``.precompute/config.json`` (None when there is none), each field of the type this module
    writes: a merge follows its ``dataset_dir`` and copies its numbers into ``features.json``, so a tampered one
    is a ``ManifestError`` naming the field, never a raw error or a manifest of nonsense."""
    path = out_dir / STATE_DIR / CONFIG_RECORD
    if not path.is_file():
        return None
    where = str(path)
    record = as_object(read_json_file(path), "the record", where=where)
    as_str(get(record, "config_hash", "", where=where), "config_hash", max_len=128, where=where)
    check_dataset_dir(get(record, "dataset_dir", "", where=where), where=where)
    for index, split in enumerate(as_list(get(record, "splits", "", where=where), "splits", where=where)):
        as_str(split, f"splits[{index}]", where=where)
    as_int(get(record, "features_dim", "", where=where), "features_dim", lo=1, hi=MAX_FEATURES_DIM, where=where)
    as_object(get(record, "provenance", "", default={}, where=where), "provenance", where=where)
    config = as_object(get(record, "config", "", where=where), "config", where=where)
    storage = as_str(get(config, "storage", "config", where=where), "config.storage", where=where)
    if storage not in FEATURE_SUFFIXES:
        raise ManifestError(f"config.storage is {storage!r:.40}: expected one of {sorted(FEATURE_SUFFIXES)}",
                            path=where)
    as_str(get(config, "dtype", "config", where=where), "config.dtype", max_len=64, where=where)
    as_int(get(config, "views", "config", where=where), "config.views", hi=MAX_VIEWS, where=where)
    return record


def check_output(out_dir: Path, record: Mapping[str, Any], *, overwrite: bool,
                 writes: Collection[str]) -> str | None:
    """Refuse to mix configs or datasets in one folder unless ``overwrite`` (writes nothing); returns the conflict
    that ``prepare_output`` must clear first, or None. Even with ``overwrite``, a file this run ``writes`` that the
    old output does not name is refused (``shards.jobs.owned.refuse_clobber``)."""
    conflict = _conflict(out_dir, read_config_record(out_dir), record)
    if conflict and not overwrite:
        raise OutputExistsError(f"{conflict}; choose another --out or pass --overwrite to replace it",
                                path=str(out_dir))
    if conflict:
        refuse_clobber(out_dir, recorded_names(out_dir), writes, writer="precompute-features")
    return conflict


def prepare_output(out_dir: Path, record: Mapping[str, Any], *, overwrite: bool, writes: Collection[str],
                   folder_lock: FolderLock | None = None) -> None:
    """``check_output``, clear an old run when ``overwrite`` says so, then record this run's config.

    Called under the writer locks (``shards.lock.claim_output``); clearing first takes the folder lock exclusively,
    so features another run is still writing are never deleted under it.
    """
    existing = read_config_record(out_dir)
    if check_output(out_dir, record, overwrite=overwrite, writes=writes):
        if folder_lock is not None:
            folder_lock.exclusive()
        log.warning("--overwrite: replacing the features in %s", out_dir)
        remove_owned(out_dir, recorded_names(out_dir), STATE_DIR)
    if existing != dict(record):
        write_json_shared(out_dir / STATE_DIR / CONFIG_RECORD, dict(record))


def _conflict(out_dir: Path, existing: Mapping[str, Any] | None, record: Mapping[str, Any]) -> str | None:
    if existing is None:
        foreign = [p.name for p in out_dir.iterdir() if p.name != STATE_DIR] if out_dir.is_dir() else []
        if foreign:
            return f"holds files ({', '.join(sorted(foreign)[:3])}) that precompute-features did not write"
        return None
    if existing.get("config_hash") != record["config_hash"]:
        changed = sorted(k for k in set(existing.get("config", {})) | set(record["config"])
                         if existing.get("config", {}).get(k) != record["config"].get(k))
        return (f"holds features of a different config (hash {existing.get('config_hash')} vs "
                f"{record['config_hash']}; differs in {', '.join(changed) or 'its hash'})")
    if existing.get("dataset_dir") != record["dataset_dir"]:
        return f"holds features of another dataset ({existing.get('dataset_dir')})"
    if existing.get("splits") != record["splits"]:
        return f"holds features of splits {existing.get('splits')}, not {record['splits']}"
    return None


def recorded_names(out_dir: Path) -> set[str]:
    """The files at the top of FEAT_DIR that what is there names as its own: ``features.json`` (itself and its
    feature files) and the shard records in ``.precompute/`` (the files of a run killed before its
    ``features.json``). Whatever they do not name is not ours."""
    names: list[Any] = []
    state = out_dir / STATE_DIR
    for record_file in state.glob("*.json") if state.is_dir() else ():
        if record_file.name == CONFIG_RECORD:
            continue
        try:
            shard = read_json_file(record_file).get("shard")
        except (OSError, ValueError, AttributeError):
            continue  # an unreadable record names nothing
        if isinstance(shard, Mapping):
            names.append(shard.get("path"))
    if (out_dir / FEATURES_FILE).is_file():
        names.append(FEATURES_FILE)
        try:
            manifest = load_feature_manifest(out_dir)
        except (ShardcacheError, OSError, ValueError):
            manifest = None  # unreadable: it is replaced, what it may have named stays
        if manifest is not None:
            names += [s.path for split in manifest.splits.values() for s in split.shards]
    return plain_names(names)


def feature_path(out_dir: Path, job: ShardJob, storage: str) -> Path:
    return out_dir / feature_shard_name(job.feature_stem or job.shard.path, storage)


def _record_path(out_dir: Path, job: ShardJob, storage: str) -> Path:
    return out_dir / STATE_DIR / (feature_path(out_dir, job, storage).stem + ".json")


def write_shard_record(out_dir: Path, job: ShardJob, storage: str, info: ShardInfo, digest: str,
                       stats: dict[str, Any] | None = None) -> None:
    """``stats``: the shard's feature statistics (``preprocess.features.feature_stats``), merged into the summary
    ``features.json`` holds when every shard is done."""
    write_json_atomic(_record_path(out_dir, job, storage), {"config_hash": digest, "split": job.split,
                                                            "shard": info.to_dict(), "stats": stats})


def shard_stats_record(out_dir: Path, job: ShardJob, storage: str) -> Any:
    """The ``stats`` of a finished shard's record (None when it was written before statistics existed)."""
    try:
        record = read_json_file(_record_path(out_dir, job, storage))
    except ShardcacheError:
        return None
    return record.get("stats") if isinstance(record, dict) else None


def finished_shard(out_dir: Path, job: ShardJob, storage: str, digest: str) -> ShardInfo | None:
    """The shard's record if its feature file is complete and current, else None (it must be computed)."""
    path = _record_path(out_dir, job, storage)
    if not path.is_file():
        return None
    try:  # a record of another shape describes nothing: its shard is computed again
        record = as_object(read_json_file(path), "the record", where=str(path))
        info = ShardInfo.from_dict(get(record, "shard", "", where=str(path)), str(path))
    except ManifestError as exc:
        log.warning("%s; recomputing", exc)
        return None
    feature_file = out_dir / info.path
    # An adopted tar's feature file is named by its place in its split (``shard_jobs``): in an index rebuilt since,
    # another tar may hold that place (its sha256 alone does not tell two copies of one tar apart).
    if record.get("config_hash") != digest or info.path != feature_path(out_dir, job, storage).name \
            or info.source != job.shard.path or not feature_file.is_file():
        return None
    stale = shard_staleness(info, job.shard.sha256) if info.source_sha256 else "its record names no source sha256"
    if stale is not None:
        log.warning("%s: %s: %s; recomputing", out_dir, job.shard.path, stale)
        return None
    if feature_file.stat().st_size != info.bytes or sha256_file(feature_file) != info.sha256:
        log.warning("%s: checksum mismatch; recomputing", feature_file)
        return None
    return info


def assemble_manifest(out_dir: Path, record: Mapping[str, Any], dataset: DatasetManifest, dataset_sha256: str,
                      jobs: Sequence[ShardJob]) -> tuple[FeatureManifest | None, list[ShardJob]]:
    """Write ``features.json`` when every job has a finished shard; return it (or None) and the missing jobs."""
    storage = record["config"]["storage"]
    infos = {job.index: finished_shard(out_dir, job, storage, record["config_hash"]) for job in jobs}
    missing = [job for job in jobs if infos[job.index] is None]
    if missing:
        return None, missing
    # A feature shard holds its image shard's samples row for row (augmented views are one [N, K, D] tensor
    # beside the features, not extra rows), so it has the same class counts: copied from the dataset each shard was
    # just checked against, so shards recorded before counts existed get them too.
    splits = {}
    for name in record["splits"]:
        source = dataset.splits[name]
        shards = tuple(dataclasses.replace(infos[job.index], class_counts=job.shard.class_counts)
                       for job in jobs if job.split == name)
        splits[name] = SplitInfo(source.samples, source.class_counts, shards)  # type: ignore[arg-type]
    config = record["config"]
    summary = check_features([shard_stats_record(out_dir, job, storage) for job in jobs], dims=record["features_dim"],
                             dtype=config["dtype"], where=str(out_dir))  # degenerate features: refused here
    manifest = FeatureManifest(
        storage=storage,
        classes=dataset.classes,
        splits=splits,
        features_dim=record["features_dim"],
        dtype=config["dtype"],
        views=config["views"],
        config=config,
        config_hash=record["config_hash"],
        dataset_dir=record["dataset_dir"],
        dataset_sha256=dataset_sha256,
        extra={"provenance": dict(record.get("provenance", {})), STATS_KEY: summary.to_json()},
    )
    with merge_lock(out_dir, STATE_DIR, what="precompute-features merge"):
        write_json_shared(out_dir / FEATURES_FILE, manifest.to_dict())
    return manifest, []


def features_spec() -> PublishSpec:
    """What ``precompute-features --out s3://`` publishes (``preprocess.staging``): ``features.json`` last, the
    feature files it may replace, and what tells a rerun of the same job from another job."""
    return PublishSpec(FEATURES_FILE,
                       lambda manifest: (manifest.get("config_hash"), manifest.get("dataset_sha256"),
                                         sorted(manifest.get("splits", {}))),
                       lambda name: name == FEATURES_FILE or is_feature_file(name))
