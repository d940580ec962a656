"""Checking a feature folder (on this machine or under ``s3://``) against its ``features.json`` and against the
dataset it was computed from.

Four kinds of problem: a feature file missing or not matching its recorded size and sha256; content that breaks
``features.json``'s promises (row counts, feature width, dtype, labels outside the class count, keys that are not
unique strings; every file is loaded with ``weights_only=True``); a stale cache (the source ``dataset.json`` changed
since, an image shard was replaced or removed, or shards were added that have no features yet); and, with ``full``,
keys and labels that differ sample for sample from the image shards. Problems are returned as one-line strings,
not raised, so ``shards verify`` can report all of them at once.

Every file is read once through its location (``shards.transport.location``): a local file in place, any other
copied to a temporary file. The source dataset is the one ``dataset_location`` follows from ``dataset_dir``
(docs/design.md, "Trust model"): only its ``dataset.json`` is read, and its image shards only as that manifest
lists them, confined to its folder or prefix, or to the caller's ``source`` where the dataset indexes tars adopted in
place (``shards index``): those are read by their row index, from the dataset's folder, as every reader reads them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shards.atomic import sha256_file
from shards.check.freshness import feature_staleness
from shards.check.verify_core import VerifyOptions
from shards.errors import MissingInputError, ShardcacheError
from shards.formats.feature_names import from_table
from shards.formats.features import FeatureShard, FeatureSpec, feature_shard_problems, load_feature_shard
from shards.transport.location import Location, locate
from shards.door.locations import dataset_location
from shards.transport.manifest_io import read_dataset_manifest, read_feature_manifest
from shards.transport.storage import get_storage
from shards.manifest import DATASET_FILE, DatasetManifest, FeatureManifest, ShardInfo
from shards.jobs.parallel import ordered_map
from shards.jobs.progress import progress

log = logging.getLogger("shardcache.check")


@dataclass(frozen=True)
class FeatureJob:
    """One feature file to check: all a worker process needs (locations carry the caller's S3 options). ``source``
    and ``image`` (the image shard the dataset's manifest lists for it, ``None`` when it lists none) are set when
    keys and labels are compared with the image shards (``full``); ``shards_at``: where those are when not beside
    the dataset's manifest (adopted tars)."""

    folder: Location
    info: ShardInfo
    spec: FeatureSpec
    source: Location | None = None
    storage: str = ""
    image: ShardInfo | None = None
    shards_at: Location | None = None


def verify_feature_folder(folder: str | os.PathLike | Location, *, full: bool = False,
                          storage_options: Any = None, workers: int = 1, quiet: bool = False,
                          source: str | os.PathLike | None = None) -> list[str]:
    """All problems found in ``folder`` (empty when the cache is complete, intact and current).

    Every feature file is loaded (``weights_only=True``) and its content checked against ``features.json``: row
    count, feature width and dtype, int64 labels within the class count, unique string keys, views. With ``full``,
    keys and labels are also compared sample for sample with the image shards when the dataset is reachable.
    ``workers`` processes check files side by side (the problems and their order are those of one process); a
    progress bar counts files on stderr unless ``quiet``. ``source``: where the image shards are when not beside
    the dataset's manifest (the tars of an index made by ``shards index``), needed to compare keys with them.
    """
    VerifyOptions(full=full, workers=workers)  # validated like the image check's
    where = locate(folder, storage_options=storage_options)
    try:
        manifest = read_feature_manifest(where)
    except ShardcacheError as exc:
        return [str(exc)]
    source_dir, dataset, unreadable = _source_dataset(where, manifest)
    spec = FeatureSpec.of(manifest)
    align = full and dataset is not None
    alignment: list[str] = []
    if align and source is None and get_storage(dataset.storage).load_index is not None:
        alignment.append(f"{where}: cannot check keys: {source_dir} indexes tars adopted in place (shards index); "
                         "give --source, the folder holding them")
        align = False
    shards_at = None if source is None else locate(source, storage_options=where.storage_options)
    listed = {s.path: s for split in dataset.splits.values() for s in split.shards} if align else {}
    jobs = [FeatureJob(where, info, spec, source_dir, dataset.storage, listed.get(info.source), shards_at) if align
            else FeatureJob(where, info, spec) for split in manifest.splits.values() for info in split.shards]
    problems: list[str] = []
    with progress(total=len(jobs), desc="verify", unit="shard", quiet=quiet) as bar:
        for found, misaligned in ordered_map(check_feature_file, jobs, workers, lambda _: bar.update(1)):
            problems.extend(found)
            alignment.extend(misaligned)
    if source_dir is None:
        return problems
    if dataset is None:
        return problems + [f"cannot check staleness: source dataset unreadable ({unreadable})"]
    return problems + feature_staleness(where, manifest, source_dir, dataset) + alignment


def check_feature_file(job: FeatureJob) -> tuple[list[str], list[str]]:
    """The problems of one feature file, and (when asked) how its keys and labels differ from its image shard."""
    problems: list[str] = []
    shard = _check_shard(job.folder, job.info, job.spec, problems)
    if shard is None or job.source is None:
        return problems, []
    return problems, _check_keys(*shard, job.source, job.storage, job.image, job.info, job.shards_at)


def _source_dataset(where: Location, manifest: FeatureManifest
                    ) -> tuple[Location | None, DatasetManifest | None, ShardcacheError | None]:
    """``(location, manifest, None)`` of the dataset the features were computed from, ``(location, None, why)`` when
    its ``dataset.json`` cannot be read, ``(None, None, None)`` when there is none to check against (a table) or
    ``dataset_dir`` is not followed (a warning says why)."""
    if from_table(manifest.config):
        return None, None, None
    location, why_not = dataset_location(where.text, manifest.dataset_dir)
    if location is None:
        log.warning("%s: cannot check staleness: %s", where, why_not)
        return None, None, None
    source = locate(location, storage_options=where.storage_options)
    try:
        return source, read_dataset_manifest(source)[0], None
    except ShardcacheError as exc:
        return source, None, exc


def _check_shard(folder: Location, info: ShardInfo, spec: FeatureSpec,
                 problems: list[str]) -> tuple[Location, FeatureShard] | None:
    """Append the problems of one feature file; the loaded shard (and where it is) when its bytes are the
    recorded ones and it loads, for the alignment check."""
    try:
        where = folder.child(info.path)
    except ShardcacheError as exc:  # a symlink out of the folder: reported, never read
        problems.append(str(exc))
        return None
    limit = info.bytes + 1
    try:
        with where.local_copy(limit) as path:
            problem = _file_problem(where, path, info, limit)
            if problem is not None:  # missing or not the bytes recorded: nothing more to learn
                problems.append(problem)
                return None
            shard = load_feature_shard(path, samples=info.samples)
            problems.extend(_content_problems(where, shard, info, spec))
            return where, shard
    except MissingInputError:
        problems.append(f"{where}: feature shard missing")
    except ShardcacheError as exc:
        problems.append(str(exc))
    return None


def _file_problem(where: Location, path: Path, info: ShardInfo, limit: int) -> str | None:
    if not path.is_file():
        raise MissingInputError("feature shard missing", path=where.text)
    size = path.stat().st_size
    if size != info.bytes:
        return f"{where}: {f'more than {info.bytes}' if size == limit else size} bytes, features.json records " \
               f"{info.bytes}"
    if sha256_file(path) != info.sha256:
        return f"{where}: sha256 does not match features.json (corrupt or replaced)"
    return None


def _content_problems(where: Location, shard: FeatureShard, info: ShardInfo, spec: FeatureSpec) -> list[str]:
    """Problems with what the file holds."""
    problems = [f"{where}: {problem}" for problem in feature_shard_problems(shard, info.samples, spec)]
    seen: set[str] = set()
    for row, key in enumerate(shard.keys):
        if key in seen:
            problems.append(f"{where}: duplicate key {key!r} at row {row}")
            break
        seen.add(key)
    return problems


def _check_keys(where: Location, shard: FeatureShard, source: Location, storage: str, listed: ShardInfo | None,
                info: ShardInfo, shards_at: Location | None = None) -> list[str]:
    """Keys and labels sample for sample against the image shard the features were computed from (``listed``: its
    entry in the dataset's manifest). Only an image shard the dataset's own manifest lists is opened, confined to
    the dataset's folder or prefix (``shards_at``'s, when given); an adopted tar by the row index in the dataset's
    folder, so its samples are the rows the index accepted, with their labels."""
    if listed is None:
        return [f"{where}: cannot check keys: source shard {info.source} is not in {source.file(DATASET_FILE)}"]
    reader = get_storage(storage)
    image = None
    try:
        rows = None if reader.load_index is None else \
            reader.load_index(source, listed, where=str(source.file(DATASET_FILE)))
        image = (source if shards_at is None else shards_at).child(info.source)
        with image.local_copy(listed.bytes + 1) as image_path:
            if not image_path.is_file():
                raise MissingInputError("missing", path=image.text)
            samples = reader.read(image_path) if rows is None else \
                reader.read_slice(image_path, 0, None, offsets=rows)
            pairs = [(sample.key, sample.label) for sample in samples]
    except MissingInputError as exc:
        if image is None:  # the row index, in the dataset's folder
            return [f"{where}: cannot check keys: {exc}"]
        return [f"{where}: cannot check keys: source shard {image} missing"]
    except (ShardcacheError, OSError) as exc:
        return [f"{where}: cannot check keys: {exc}"]
    keys = [key for key, _ in pairs]
    if keys != list(shard.keys):
        first = next((i for i, (a, b) in enumerate(zip(keys, shard.keys)) if a != b), min(len(keys), len(shard)))
        image_key = keys[first] if first < len(keys) else "(none)"
        feature_key = shard.keys[first] if first < len(shard) else "(none)"
        return [f"{where} [sample {feature_key}]: keys differ from {image} (first at row {first}: the image shard "
                f"has {image_key})"]
    labels = shard.labels.tolist()
    if [label for _, label in pairs] != labels:
        wrong = next((i for i, ((_, a), b) in enumerate(zip(pairs, labels)) if a != b), min(len(pairs), len(labels)))
        key = keys[wrong] if wrong < len(keys) else "(none)"
        return [f"{where} [sample {key}]: labels differ from {image} (first at row {wrong})"]
    return []
