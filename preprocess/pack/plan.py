"""Deciding, before anything is written, which sample goes to which split and which shard.

The plan is a pure function of the scanned source and the packing options, so every Slurm task computes the
same plan on its own and packs its share; its digest identifies the output, which is how a rerun knows whether a
folder holds an unfinished run of the same job (resume) or something else (refuse without ``--overwrite``).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence, TypeVar

from preprocess.pack.sources import SourceSample, SourceScan
from shards.errors import InputError
from shards.formats.storage import shard_name

T = TypeVar("T")

SPLIT_ORDER = ("train", "val", "test")
# Three 512-byte tar headers plus padding and metadata per sample: keeps --max-bytes honest for small files.
SAMPLE_OVERHEAD_BYTES = 2048


class PlannedShard(NamedTuple):
    name: str
    split: str
    samples: tuple[SourceSample, ...]


@dataclass(frozen=True)
class PackPlan:
    scan: SourceScan
    shards: tuple[PlannedShard, ...]
    packing: Mapping[str, Any]
    sha256: str

    @property
    def splits(self) -> list[str]:
        return list(dict.fromkeys(s.split for s in self.shards))


def split_order_key(name: str) -> tuple[int, str]:
    return (SPLIT_ORDER.index(name), "") if name in SPLIT_ORDER else (len(SPLIT_ORDER), name)


def stratified_val(by_class: Mapping[str, Sequence[T]], fraction: float, seed: int) -> list[T]:
    """The validation members carved out of train (image folders and tables alike): ``fraction`` of every class
    (``by_class``: class name -> members in a canonical order), at least one and never all of a class of two or
    more, chosen by a generator seeded from the seed and the class name (not from a shared stream), so adding a
    class never reshuffles the others."""
    chosen: list[T] = []
    for name, members in by_class.items():
        order = list(members)
        n_val = min(max(round(fraction * len(order)), 1), len(order) - 1) if len(order) >= 2 else 0
        random.Random(f"{seed}/val/{name}").shuffle(order)
        chosen.extend(order[:n_val])
    return chosen


def assign_splits(scan: SourceScan, val_fraction: float, seed: int) -> dict[str, list[SourceSample]]:
    """Group samples by split in source order; carve a stratified ``val`` out of ``train`` when asked."""
    groups: dict[str, list[SourceSample]] = defaultdict(list)
    for sample in scan.samples:
        groups[sample.split or "train"].append(sample)
    if val_fraction > 0:
        if "val" in groups:
            raise InputError(f"--val-fraction {val_fraction} given, but the source already has a val split",
                             path=scan.root)
        by_class: dict[str, list[SourceSample]] = defaultdict(list)
        for sample in sorted(groups["train"], key=lambda s: s.rel_path):
            by_class[scan.classes[sample.label]].append(sample)
        val_keys = {s.key for s in stratified_val(by_class, val_fraction, seed)}
        groups["val"] = [s for s in groups["train"] if s.key in val_keys]
        groups["train"] = [s for s in groups["train"] if s.key not in val_keys]
    return {name: groups[name] for name in sorted(groups, key=split_order_key) if groups[name]}


def cut_shards(samples: Sequence[SourceSample], split: str, storage: str, max_samples: int,
               max_bytes: int) -> list[PlannedShard]:
    """Fill shards in order, starting a new one when either limit would be passed (a lone big file still fits)."""
    shards: list[PlannedShard] = []
    current: list[SourceSample] = []
    current_bytes = 0
    for sample in samples:
        cost = sample.size + SAMPLE_OVERHEAD_BYTES
        if current and (len(current) >= max_samples or current_bytes + cost > max_bytes):
            shards.append(PlannedShard(shard_name(split, len(shards), storage), split, tuple(current)))
            current, current_bytes = [], 0
        current.append(sample)
        current_bytes += cost
    if current:
        shards.append(PlannedShard(shard_name(split, len(shards), storage), split, tuple(current)))
    return shards


def plan_digest(scan: SourceScan, shards: Sequence[PlannedShard], packing: Mapping[str, Any]) -> str:
    """Digest of everything that decides the output bytes: options, classes, and each shard's files
    (relative path, size, mtime), so a changed source or option reads as a different dataset."""
    digest = hashlib.sha256()
    header = {"packing": dict(packing), "classes": list(scan.classes), "kind": scan.kind}
    digest.update(json.dumps(header, sort_keys=True).encode("utf-8"))
    for shard in shards:
        rows = [[s.key, s.rel_path, s.size, s.mtime_ns, s.label] for s in shard.samples]
        digest.update(json.dumps([shard.name, shard.split, rows], ensure_ascii=False).encode("utf-8"))
    return digest.hexdigest()


def make_plan(scan: SourceScan, packing: Mapping[str, Any], storage: str) -> PackPlan:
    """``packing`` holds seed, shuffle, val_fraction, max_samples and max_bytes (and whatever else shapes bytes)."""
    seed = int(packing["seed"])
    shards: list[PlannedShard] = []
    for split, samples in assign_splits(scan, float(packing["val_fraction"]), seed).items():
        ordered = list(samples)
        if packing["shuffle"]:
            ordered.sort(key=lambda s: s.rel_path)
            random.Random(f"{seed}/shuffle/{split}").shuffle(ordered)
        shards.extend(cut_shards(ordered, split, storage, int(packing["max_samples"]), int(packing["max_bytes"])))
    return PackPlan(scan, tuple(shards), dict(packing), plan_digest(scan, shards, packing))
