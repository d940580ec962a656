"""The key of any row of a dataset's split from its sources' column indexes, without reading a sample.

The resume audit (``shards.position.audit``) asks the plan for the keys of a few batches at every save and resume;
read from the shards, each is a batch of images read again (about a second for two batches of 64 ImageNet-size
JPEGs on two cores). The column index (``shards.select.columns``, written by ``pack-shards``) holds every row's key,
mapped and checked against ``dataset.json`` once per process, so a batch's keys are an index into it. A mixture's
rows map to each source's own column by the shards it kept, as its labels do (``shards.select.labels``).

Only the process that made the dataset uses it: pickled into a DataLoader worker it carries nothing and answers
None, as it does for a source without a column index (feature folders, datasets packed before it existed) or one
that fails its checks (logged); the audit then reads the keys from the shards.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from shards.errors import ShardcacheError
from shards.order.plan import shard_offsets

log = logging.getLogger(__name__)


class KeyColumns:
    """Keys by global row of a split whose shards are at ``locations``, from ``sources`` (``LoadedSource``: their
    shard locations and ``columns()``), each source's key column opened on first use."""

    def __init__(self, locations: Sequence[str], sources: Sequence[Any]):
        self._sources = list(sources)
        held: dict[str, tuple[int, int]] = {}  # shard location -> (source, its first row in the source's split)
        for number, source in enumerate(self._sources):
            starts = shard_offsets(source.split.shard_sizes)
            for shard, location in enumerate(source.locations):
                held.setdefault(location, (number, int(starts[shard])))
        self._shards = [held.get(location) for location in locations]
        self._columns: dict[int, np.ndarray | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"_sources": [], "_shards": [], "_columns": {}}  # the main process's alone: see the module docstring

    def keys(self, rows: np.ndarray, offsets: np.ndarray) -> list[str] | None:
        """The keys of global ``rows`` (the split's shards start at ``offsets``), or None where a row's source has
        no usable key column."""
        if not self._shards or any(entry is None for entry in self._shards):
            return None
        rows = np.asarray(rows, dtype=np.int64)
        shards = np.searchsorted(offsets, rows, side="right") - 1
        out = []
        for row, shard in zip(rows.tolist(), shards.tolist()):
            number, first = self._shards[shard]
            column = self._column(number)
            if column is None:
                return None
            out.append(bytes(column[first + row - int(offsets[shard])]).decode("utf-8", "surrogateescape"))
        return out

    def _column(self, number: int) -> np.ndarray | None:
        if number not in self._columns:
            try:
                columns = self._sources[number].columns()
                self._columns[number] = None if columns is None else columns.column("key")
            except ShardcacheError as exc:  # the shards still answer: the audit reads its keys from them
                log.warning("the column index of %s cannot give keys (%s); keys are read from the shards",
                            self._sources[number].spec.path, exc)
                self._columns[number] = None
        return self._columns[number]
