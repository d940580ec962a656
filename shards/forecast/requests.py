"""What one read costs the storage it reaches: requests and bytes, by the rules the location layer reads by.

Nothing here reads a shard. The byte range a slice of a tar shard occupies comes from its byte index when the caller
loaded it (``ShardSpans.exact``: the ``.idx`` sidecars, 8 bytes a sample), else from the manifest's shard size spread
evenly over its samples (``ShardSpans.estimate``), less the tar end-of-archive blocks and record padding a writer
adds after the last sample; a whole shard's reads lose at most half a tar record (5 KiB) to that estimate.

The counts follow ``shards.transport``: a ranged read of ``n`` bytes is ``ceil(n / part)`` GETs of
``parallel_parts.part_length`` bytes; a whole object of unknown size (the node cache's fetch, ``open_whole``) one
GET of ``FIRST_PART`` bytes and the rest in parts; a byte-index sidecar one GET per ``RANGE_CHUNK``. A local file
costs one read (open and seek) per covering read and has no requests to bill. ``AheadTable`` replays which slices
a stream offers to the read-ahead table before their turn (the same GETs, started early).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from shards.transport import parallel_parts
from shards.transport.parallel_parts import MAX_AHEAD
from shards.transport import s3 as s3_core

TAR_END = 2 * 512  # the two zero blocks that end a tar archive
AHEAD_READS = 1024  # covering reads past the current one a stream offers for read-ahead (``shards.stream``'s)
TAR_RECORD = 20 * 512  # tar files are padded to a whole record after them


@dataclass
class Traffic:
    """Requests and bytes one storage tier served, and how many requests of each size (for prices by request
    size: ``shards.forecast.prices``)."""

    requests: int = 0
    bytes: int = 0
    sizes: Counter = field(default_factory=Counter)

    def add(self, sizes: Sequence[int]) -> None:
        for size in sizes:
            self.requests += 1
            self.bytes += int(size)
            self.sizes[int(size)] += 1

    def merge(self, other: Traffic) -> None:
        self.requests += other.requests
        self.bytes += other.bytes
        self.sizes.update(other.sizes)

    def over(self, free_bytes: int) -> int:
        """Bytes beyond the first ``free_bytes`` of each request (what a per-request allowance leaves billed)."""
        return sum(max(0, size - free_bytes) * count for size, count in self.sizes.items())

    def to_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "bytes": self.bytes}


def ranged_sizes(length: int, connections: int) -> list[int]:
    """The GETs of a ``length``-byte range read in parallel parts (``parallel_parts.PartStream``)."""
    if length <= 0:
        return []
    part = parallel_parts.part_length(length, connections)
    full, rest = divmod(length, part)
    return [part] * full + ([rest] if rest else [])


def whole_object_sizes(size: int, connections: int) -> list[int]:
    """The GETs of a whole object read without knowing its size first (``s3_parallel.open_whole``): one of
    ``FIRST_PART`` bytes, whose answer gives the size, then the rest in parts."""
    first = min(size, parallel_parts.FIRST_PART)
    return [first, *ranged_sizes(size - first, connections)]


def single_range_sizes(length: int) -> list[int]:
    """The GETs of one ``RangeReader`` over ``length`` bytes (an index sidecar): one per ``RANGE_CHUNK``."""
    chunk = s3_core.RANGE_CHUNK
    full, rest = divmod(length, chunk)
    return [chunk] * full + ([rest] if rest else []) or [0]


class ShardSpans:
    """Where samples ``start:stop`` of each shard lie in its bytes: exactly, from loaded byte indexes, or by the
    estimate in the module docstring."""

    def __init__(self, shard_bytes: Sequence[int], shard_samples: Sequence[int],
                 offsets: Sequence[np.ndarray | None] | None = None):
        self.shard_bytes = [int(b) for b in shard_bytes]
        self.shard_samples = [int(n) for n in shard_samples]
        self.offsets = list(offsets) if offsets is not None else [None] * len(self.shard_bytes)

    @property
    def exact(self) -> bool:
        return all(o is not None for o in self.offsets)

    def data_end(self, shard: int) -> float:
        """Where the last sample of ``shard`` ends (estimated: half a record of padding before the end blocks)."""
        known = self.offsets[shard]
        if known is not None:
            return float(known[-1])
        size = self.shard_bytes[shard]
        padding = min(TAR_RECORD / 2, max(0.0, size - TAR_END) / 2)
        return max(0.0, size - TAR_END - padding)

    def span(self, shard: int, start: int, stop: int) -> int:
        """The bytes samples ``start:stop`` of ``shard`` occupy."""
        known = self.offsets[shard]
        if known is not None:
            stop = min(stop, len(known) - 1)
            return int(known[stop]) - int(known[start]) if start < stop else 0
        samples = self.shard_samples[shard]
        if not samples:
            return 0
        per_sample = self.data_end(shard) / samples
        return int(round((min(stop, samples) - start) * per_sample))

    def prefix(self, shard: int, stop: int) -> int:
        """The bytes before sample ``stop`` (what a stream from byte 0 reads to reach the end of a slice)."""
        return self.span(shard, 0, stop)


def load_offsets(locations: Sequence[Any], infos: Sequence[Any]) -> list[np.ndarray | None]:
    """Each tar shard's checked byte index, read through its location (``Location.load_index``: the ``.idx``
    sidecar, checked against the manifest's size and sha256); None where the manifest records none."""
    return [where.load_index(info) for where, info in zip(locations, infos)]


class AheadTable:
    """``ImageShardDataset._read_ahead`` over one stream: which reads were offered to the read-ahead table before
    their turn, within ``read_ahead_bytes`` (``parallel_parts.ReadAhead.offer``: a range always fits an empty
    table); ``early``: those reads."""

    def __init__(self, budget: int):
        self.budget = budget
        self.cursor = 0
        self.held: list[tuple[int, int]] = []  # (read, bytes) offered and not yet read
        self.early: set[int] = set()

    def offer(self, pieces: Sequence[Any], i: int, spans: ShardSpans, through_cache: Any) -> None:
        """Before read ``i`` of ``pieces`` (a stream's covering reads, ``ShardSlice``s): offer it and the reads after
        it while the budget has room."""
        self.held = [(j, b) for j, b in self.held if j >= i]  # the reader took those before ``i``
        k = max(self.cursor, i)
        while k < min(len(pieces), i + AHEAD_READS):
            piece = pieces[k]
            if not through_cache(piece.shard):
                size = spans.span(piece.shard, piece.start, piece.stop)
                held = sum(b for _, b in self.held)
                if self.budget <= 0 or len(self.held) >= MAX_AHEAD or (self.held and held + size > self.budget):
                    break
                self.held.append((k, size))
                if k > i:
                    self.early.add(k)
            k += 1
        self.cursor = k
