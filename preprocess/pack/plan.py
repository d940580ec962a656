"""Deciding, before anything is written, which sample goes to which split and which shard.

The plan is a pure function of the scanned source and the packing options, so every Slurm task computes the
same plan on its own and packs its share; its digest identifies the output, which is how a rerun knows whether a
folder holds an unfinished run of the same job (resume) or something else (refuse without ``--overwrite``).
"""

from __future__ import annotations

import hashlib
import json
import random
from array import array
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence, TypeVar

import numpy as np

from preprocess.pack.sources.columns import NO_SPLIT, SourceSample, SourceSamples
from preprocess.pack.sources.scan import SourceScan
from shards.errors import InputError
from shards.transport.storage import shard_name

T = TypeVar("T")

SPLIT_ORDER = ("train", "val", "test")
# Per sample, what a shard holds beyond the source bytes: three 512-byte tar headers, up to 511 bytes of padding
# after each of the image and the .json member, the label's block and a .json of up to 512 bytes (a path and class of
# a few hundred characters). An HDF5 shard needs less. Per shard: the tar's end marker and its last record's
# padding. Together they keep --max-bytes a bound, not an estimate (2048 per sample and nothing per shard had each
# 256 KB tar of 14 kB images 5% over).
SAMPLE_OVERHEAD_BYTES = 3 * 512 + 2 * 511 + 512 + 512
SHARD_OVERHEAD_BYTES = 2 * 512 + 10240


class PlannedShard(NamedTuple):
    """One output shard: its samples are a view of the scan's columns (``SourceSamples``) when ``make_plan`` cut
    it, so a plan of N files costs 8 bytes a file beyond the scan, and a job pickles only its own rows."""

    name: str
    split: str
    samples: Sequence[SourceSample]


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


def seeded_shuffle(values: np.ndarray, seed: str) -> np.ndarray:
    """``values`` in the order ``random.Random(seed).shuffle`` gives a list of them (the order every earlier pack
    used, so plans and their digests stay the same); only the positions are shuffled, 8 bytes each in an
    ``array`` (a list of ints would be 36)."""
    order = array("q", range(len(values)))
    random.Random(seed).shuffle(order)
    return values[np.frombuffer(order, dtype=np.int64)] if len(order) else values


def by_rel_path(samples: SourceSamples, positions: np.ndarray) -> np.ndarray:
    """``positions`` (into ``samples``) sorted by relative path. An image folder's scan is sorted already: that
    is checked pass by pass over the paths, holding two; only an unsorted list file's paths are held to sort."""
    view = samples.take(positions)
    previous = None
    for path in view.rel_paths():
        if previous is not None and path < previous:
            paths = list(view.rel_paths())
            return positions[np.array(sorted(range(len(paths)), key=paths.__getitem__), dtype=np.int64)]
        previous = path
    return positions


def split_positions(scan: SourceScan, val_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Positions of ``scan.samples`` per split, in source order; a stratified ``val`` is carved out of ``train``
    when asked. Splits in ``split_order_key`` order, empty ones left out."""
    samples = scan.samples
    codes = samples.column("split")
    names = {NO_SPLIT: "train", **dict(enumerate(samples.split_names))}
    groups: dict[str, np.ndarray] = {}
    for code in np.unique(codes).tolist():
        name = names[code]
        found = np.flatnonzero(codes == code)
        groups[name] = np.sort(np.concatenate([groups[name], found])) if name in groups else found
    if val_fraction > 0:
        if "val" in groups:
            raise InputError(f"--val-fraction {val_fraction} given, but the source already has a val split",
                             path=scan.root)
        groups.setdefault("train", np.zeros(0, dtype=np.int64))
        train = by_rel_path(samples, groups["train"])
        labels = samples.column("label")[train]
        # Each class draws from its own seeded generator, so the order of the classes does not matter.
        by_class = {scan.classes[label]: train[labels == label] for label in np.unique(labels).tolist()}
        chosen = stratified_val(by_class, val_fraction, seed)
        is_val = np.zeros(len(samples), dtype=bool)
        is_val[np.array(chosen, dtype=np.int64)] = True
        groups["val"] = np.flatnonzero(is_val)
        groups["train"] = groups["train"][~is_val[groups["train"]]]
    return {name: groups[name] for name in sorted(groups, key=split_order_key) if len(groups[name])}


def assign_splits(scan: SourceScan, val_fraction: float, seed: int) -> dict[str, SourceSamples]:
    """``split_positions`` as samples: each split's files in source order."""
    return {name: scan.samples.take(positions)
            for name, positions in split_positions(scan, val_fraction, seed).items()}


def shard_bounds(sizes: np.ndarray, max_samples: int, max_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each shard when files of these sizes fill shards in order, a new one starting when
    either limit would be passed (a lone big file still fits). One binary search per shard, not a step per file:
    a shard ends at the first file whose running cost passes its start's cost plus ``max_bytes``."""
    cost = np.cumsum(np.asarray(sizes, dtype=np.int64) + SAMPLE_OVERHEAD_BYTES)
    room = max(1, max_bytes - SHARD_OVERHEAD_BYTES)
    bounds: list[tuple[int, int]] = []
    start, n = 0, len(cost)
    while start < n:
        before = int(cost[start - 1]) if start else 0
        over = int(np.searchsorted(cost, before + room, side="right"))
        stop = max(start + 1, min(over, start + max_samples, n))
        bounds.append((start, stop))
        start = stop
    return bounds


def cut_shards(samples: Sequence[SourceSample], split: str, storage: str, max_samples: int,
               max_bytes: int) -> list[PlannedShard]:
    """The shards of one split's files in this order (``shard_bounds``), each a slice of ``samples``."""
    if isinstance(samples, SourceSamples):
        sizes = samples.column("size")
    else:
        sizes = np.fromiter((s.size for s in samples), dtype=np.int64, count=len(samples))
    return [PlannedShard(shard_name(split, i, storage), split, samples[start:stop])
            for i, (start, stop) in enumerate(shard_bounds(sizes, max_samples, max_bytes))]


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


def block_shuffle(samples: SourceSamples, positions: np.ndarray, seed: str) -> np.ndarray:
    """``positions`` (in source order) with their blocks in a seeded random order, each block's samples together:
    how a source read a block at a time (a Parquet row group) is shuffled, so a shard reads few blocks, and a block
    once, instead of every block of the source (a sample-level shuffle made each shard decode nearly all of them)."""
    blocks = samples.column("block")[positions]
    unique = np.unique(blocks)
    rank = np.empty(len(unique), dtype=np.int64)
    rank[np.searchsorted(unique, seeded_shuffle(unique, seed))] = np.arange(len(unique))
    return positions[np.argsort(rank[np.searchsorted(unique, blocks)], kind="stable")]


def make_plan(scan: SourceScan, packing: Mapping[str, Any], storage: str) -> PackPlan:
    """``packing`` holds seed, shuffle, val_fraction, max_samples and max_bytes (and whatever else shapes bytes).
    Shuffled splits are sorted by relative path first, so the order never depends on how the source was listed.
    A source read by blocks is shuffled block by block (``block_shuffle``), then within each shard."""
    seed = int(packing["seed"])
    shards: list[PlannedShard] = []
    by_block = bool(packing["shuffle"]) and scan.samples.has_blocks
    for split, positions in split_positions(scan, float(packing["val_fraction"]), seed).items():
        if by_block:
            positions = block_shuffle(scan.samples, positions, f"{seed}/shuffle/{split}")
        elif packing["shuffle"]:
            positions = seeded_shuffle(by_rel_path(scan.samples, positions), f"{seed}/shuffle/{split}")
        cut = cut_shards(scan.samples.take(positions), split, storage, int(packing["max_samples"]),
                         int(packing["max_bytes"]))
        if by_block:
            cut = [shard._replace(samples=shard.samples.take(
                seeded_shuffle(np.arange(len(shard.samples)), f"{seed}/shuffle/{shard.name}"))) for shard in cut]
        shards.extend(cut)
    return PackPlan(scan, tuple(shards), dict(packing), plan_digest(scan, shards, packing))
