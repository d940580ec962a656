"""The resume state of a feature folder, and the assembly of ``features.json`` from it.

``FEAT_DIR/.precompute/config.json`` records what the folder is computing (the hashed config, the dataset folder);
``FEAT_DIR/.precompute/<shard>.json`` is written after its feature file is renamed into place and records that
file's ``ShardInfo``. A shard counts as finished only when its record, the config hash, the source shard's
checksum and the feature file's own checksum all agree, so a killed run (a ``.tmp`` left, a record missing) is
simply completed by the next run, and parallel tasks never write the same file. ``features.json`` is assembled
from the records last, atomically, and only when every shard has one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any, Mapping, Sequence

from preprocess.features.loader import ShardJob
from shards.atomic import TMP_SUFFIX, fsync_dir, sha256_file, write_json_atomic
from shards.errors import OutputExistsError
from shards.formats.features import feature_shard_name
from shards.manifest import FEATURES_FILE, DatasetManifest, FeatureManifest, ShardInfo, SplitInfo

log = logging.getLogger(__name__)

STATE_DIR = ".precompute"
CONFIG_RECORD = "config.json"


def config_hash(config: Mapping[str, Any]) -> str:
    """Digest of everything that changes the numbers; canonical JSON, so key order never matters."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def write_json_shared(final: Path, obj: Any) -> None:
    """Like ``write_json_atomic`` but safe when several array tasks write the same file at once.

    Each writer uses its own temp name (host and pid), so two tasks finishing together cannot interleave bytes
    in one ``.tmp``; both rename complete files, and the content they write is the same.
    """
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    tmp = final.with_name(f"{final.name}.{socket.gethostname()}-{os.getpid()}{TMP_SUFFIX}")
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(final.parent)


def read_config_record(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / STATE_DIR / CONFIG_RECORD
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def prepare_output(out_dir: Path, record: Mapping[str, Any], *, overwrite: bool) -> None:
    """Refuse to mix configs or datasets in one folder unless ``overwrite``; then record this run's config."""
    existing = read_config_record(out_dir)
    conflict = _conflict(out_dir, existing, record)
    if conflict and not overwrite:
        raise OutputExistsError(f"{conflict}; choose another --out or pass --overwrite to replace it",
                                path=str(out_dir))
    if conflict:
        log.warning("--overwrite: replacing the features in %s", out_dir)
        _clear(out_dir, existing)
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


def _clear(out_dir: Path, existing: Mapping[str, Any] | None) -> None:
    """Remove what an earlier run wrote here (feature files named by its records, records, features.json)."""
    state = out_dir / STATE_DIR
    if state.is_dir():
        for record_file in state.glob("*.json"):
            if record_file.name != CONFIG_RECORD:
                shard = json.loads(record_file.read_text(encoding="utf-8")).get("shard", {})
                if shard.get("path"):
                    (out_dir / shard["path"]).unlink(missing_ok=True)
        shutil.rmtree(state)
    (out_dir / FEATURES_FILE).unlink(missing_ok=True)
    for leftover in out_dir.glob(f"*{TMP_SUFFIX}"):
        leftover.unlink()


def feature_path(out_dir: Path, job: ShardJob, storage: str) -> Path:
    return out_dir / feature_shard_name(job.name, storage)


def _record_path(out_dir: Path, job: ShardJob, storage: str) -> Path:
    return out_dir / STATE_DIR / (Path(feature_shard_name(job.name, storage)).stem + ".json")


def write_shard_record(out_dir: Path, job: ShardJob, storage: str, info: ShardInfo, digest: str) -> None:
    write_json_atomic(_record_path(out_dir, job, storage), {"config_hash": digest, "split": job.split,
                                                            "shard": info.to_dict()})


def finished_shard(out_dir: Path, job: ShardJob, storage: str, digest: str) -> ShardInfo | None:
    """The shard's record if its feature file is complete and current, else None (it must be computed)."""
    path = _record_path(out_dir, job, storage)
    if not path.is_file():
        return None
    record = json.loads(path.read_text(encoding="utf-8"))
    info = ShardInfo.from_dict(record["shard"])
    feature_file = out_dir / info.path
    if record.get("config_hash") != digest or not feature_file.is_file():
        return None
    if info.source_sha256 != job.sha256:
        log.warning("%s: image shard %s changed since its features were computed; recomputing", out_dir, job.name)
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
    splits = {}
    for name in record["splits"]:
        source = dataset.splits[name]
        shards = tuple(infos[job.index] for job in jobs if job.split == name)
        splits[name] = SplitInfo(source.samples, source.class_counts, shards)  # type: ignore[arg-type]
    config = record["config"]
    manifest = FeatureManifest(
        storage=storage,
        classes=dataset.classes,
        splits=splits,
        features_dim=int(record["features_dim"]),
        dtype=config["dtype"],
        views=int(config["views"]),
        config=config,
        config_hash=record["config_hash"],
        dataset_dir=record["dataset_dir"],
        dataset_sha256=dataset_sha256,
        extra={"provenance": dict(record.get("provenance", {}))},
    )
    write_json_shared(out_dir / FEATURES_FILE, manifest.to_dict())
    return manifest, []
