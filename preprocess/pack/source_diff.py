"""What changed in a source since it was packed: files new, changed (size, mtime or label) and gone.

``pack-shards --append`` packs the difference; a plain ``pack-shards`` into a folder packed from the same source
before names it in its refusal (``describe_change``), so a user whose photo folder grew learns how much grew and
that ``--append`` packs just that. A packed file is known by its source-relative path with size and mtime, from
the source index that packing writes (``source-index*.jsonl``, named in ``dataset.json``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from preprocess.pack.sources.columns import SourceSample
from preprocess.pack.sources.scan import SourceScan
from shards.atomic import sha256_file
from shards.door.jsonlines import json_lines
from shards.door.locations import local_shard_path
from shards.errors import CorruptDataError, ManifestError, ShardcacheError
from shards.manifest import DATASET_FILE, DatasetManifest, load_dataset_manifest


@dataclass(frozen=True)
class SourceDiff:
    """The source compared with the index: files to pack, files whose packed version is outdated or gone."""

    new: tuple[SourceSample, ...]
    changed: tuple[SourceSample, ...]  # the current version of files whose size, mtime or label changed
    disappeared: tuple[str, ...]  # relative paths
    unchanged: int


def read_index(out: Path, manifest: DatasetManifest) -> dict[str, dict[str, Any]]:
    """The committed source index (relative path -> row), checked against the checksum in ``dataset.json``."""
    entry = manifest.extra.get("source_index")
    if not isinstance(entry, Mapping) or "path" not in entry:
        raise ManifestError("records no source index, so --append cannot tell what is packed; repack it",
                            path=str(out / DATASET_FILE))
    path = local_shard_path(out, entry["path"], where=str(out / DATASET_FILE), what="source index")
    if not path.is_file():
        raise ManifestError(f"source index {entry['path']} is missing", path=str(out))
    if entry.get("sha256") and sha256_file(path) != entry["sha256"]:
        raise CorruptDataError("source index does not match the checksum in dataset.json", path=str(path))
    index: dict[str, dict[str, Any]] = {}
    for number, row, bad in json_lines(path.read_text(encoding="utf-8")):
        if bad is not None:
            raise CorruptDataError(f"source index line {number} is not JSON ({bad})", path=str(path))
        index[row["path"]] = row
    return index


def diff_source(samples: Iterable[SourceSample], index: Mapping[str, Mapping[str, Any]]) -> SourceDiff:
    new, changed, seen = [], [], set()
    for sample in samples:
        seen.add(sample.rel_path)
        row = index.get(sample.rel_path)
        if row is None:
            new.append(sample)
        elif (row["size"], row["mtime_ns"], row["label"]) != (sample.size, sample.mtime_ns, sample.label):
            changed.append(sample)
    disappeared = tuple(sorted(set(index) - seen))
    return SourceDiff(tuple(new), tuple(changed), disappeared, len(seen) - len(new) - len(changed))


def describe_change(out: Path, scan: SourceScan, packing: Mapping[str, Any]) -> str:
    """Why the dataset in ``out`` differs from what packing ``scan`` with ``packing`` would make, and what to pass:
    the counts of new, changed and removed files (and ``--append``), or the packing options that differ."""
    try:
        manifest = load_dataset_manifest(out)
        index = read_index(out, manifest)
    except (ShardcacheError, OSError):
        return ("other source files or options (it records no source index to compare with); pass --overwrite "
                "to replace it")
    to_label = {name: i for i, name in enumerate(manifest.classes)}
    samples = [s._replace(label=to_label.get(scan.classes[s.label], -1)) for s in scan.samples]
    diff = diff_source(samples, index)
    counts = [f"{n} {what}" for n, what in ((len(diff.new), "new"), (len(diff.changed), "changed"),
                                             (len(diff.disappeared), "removed")) if n]
    if counts:
        return (f"the source has {', '.join(counts)} file(s) since it was packed; pass --append to pack the new "
                "ones into new shards (--append --prune also drops changed and removed ones), or --overwrite to "
                "repack it all")
    options = sorted(k for k in packing if packing[k] != manifest.packing.get(k))
    what = f"packing options ({', '.join(options)})" if options else "source files or options"
    return f"the same source files but other {what}; pass --overwrite to repack"
