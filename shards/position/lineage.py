"""Step lineage: which rows, keys and shards one batch of one rank holds, computed from the order, never logged.

A loader's batches are a pure function of the epoch's order (``shards.order.order.worker_order``) and the
layout: a rank's batches come round robin from its workers (DataLoader's in-order round robin, skipping exhausted
workers: ``plan.round_robin_consumed``, the same arithmetic resume uses), and worker ``w``'s ``j``-th batch is its
yielded rows ``j * batch_size`` to ``(j + 1) * batch_size``. An epoch continued in another layout is a chain of
saved states (``LoaderState.prior``): batches before the layout change come from the older layout over its own
stream, later ones from the new layout over the rows the older one had left (``elastic.remaining_after``, the
replay resume itself uses). So lineage calls the same functions as the running loader and cannot disagree with it,
class weighting included: the weighted draws are the order's rows (``shards.order.weights``), a row drawn twice is
in its batches twice.

Keys are read from the shards for the batch's rows only (one covering read per shard touched, no decoding).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from shards.errors import InputError
from shards.position.elastic import SavedState, remaining_after, without
from shards.order.order import EpochSource, Layout, worker_order
from shards.order.plan import ShardSlice, epoch_sizes, round_robin_consumed, shard_offsets
from shards.position.resume import LoaderState, worker_batches


def state_chain(saved: SavedState) -> list[SavedState]:
    """The layouts an epoch went through, oldest first, each with the rows its stream left out: ``saved`` and the
    states it continued."""
    chain = [saved]
    while chain[-1].prior is not None:
        chain.append(chain[-1].prior)
    return chain[::-1]


def batch_rows(source: EpochSource, position: LoaderState | SavedState, rank: int, batch: int) -> np.ndarray:
    """Global rows of batch ``batch`` (from 0, counted over the whole epoch) of ``rank`` in ``position``'s epoch,
    in the order the batch holds them. ``position`` is the state of the layout in force, over ``source`` (its
    ``prior`` chain: the layouts that fed the epoch's earlier batches); its own ``batches`` do not matter. A
    loaded state comes parsed (``SavedState``, its excluded rows ``source``'s); a loader's own position is a
    ``LoaderState``."""
    if isinstance(position, SavedState):
        chain = state_chain(position)
    else:
        chain = state_chain(SavedState.of(position, source.excluded))
    stream = None  # the epoch's own stream for the first layout; the rows left after it for each later one
    for index, saved in enumerate(chain):
        state = saved.position
        start = chain[index - 1].position.batches if index else 0
        if index == len(chain) - 1 or batch < state.batches:
            stream = None if stream is None else without(stream, saved.excluded)
            return _layout_batch(replace(source, excluded=saved.excluded), state, stream, rank, batch - start)
        stream = remaining_after(source, saved)
    raise AssertionError("unreachable: the last layout takes every later batch")


def _layout_batch(source: EpochSource, state: LoaderState, stream: np.ndarray | None, rank: int,
                  batch: int) -> np.ndarray:
    """Batch ``batch`` (from 0, within this layout) of ``rank`` in ``state``'s layout over ``stream``."""
    if not 0 <= rank < (state.world_size or 1):
        raise InputError(f"rank {rank} is not in the run's world size {state.world_size}")
    rows_in_epoch = len(stream) if stream is not None \
        else len(source.epoch_stream(state.epoch, state.world_size, state.node_count))
    per_rank = epoch_sizes(rows_in_epoch, state.world_size, source.drop_last).per_rank
    size = state.batch_size
    counts = worker_batches(per_rank, state.logical_workers, size, state.drop_last, state.split_batch or 1)
    if not 0 <= batch < sum(counts):
        raise InputError(f"batch {batch} is outside this layout's {sum(counts)} batches of epoch {state.epoch + 1}")
    taken, worker = round_robin_consumed(counts, batch)
    order = worker_order(source, Layout.of(state), state.epoch, rank, worker, stream)
    first = taken[worker] * size
    return order.yielded(first + size)[first:]


def row_samples(dataset: Any, rows: Sequence[int], stand_ins: Sequence[int] = ()) -> list[dict[str, Any]]:
    """``{"key", "shard", "row"}`` for each global row of ``dataset``'s split, in the order given; a row in
    ``stand_ins`` (quarantined: a stand-in was fed in its place) also carries ``"stand_in": True``. Each shard
    touched is read once over the span of its wanted rows; nothing is decoded."""
    rows = np.asarray(rows, dtype=np.int64)
    offsets = shard_offsets(dataset.shard_sizes)
    shards = np.searchsorted(offsets, rows, side="right") - 1
    keys: dict[int, str] = {}
    for shard in np.unique(shards).tolist():
        local = rows[shards == shard] - offsets[shard]
        low, high = int(local.min()), int(local.max()) + 1
        wanted = set(local.tolist())
        for offset, sample in enumerate(dataset.read_slice(ShardSlice(shard, low, high))):
            if low + offset in wanted:
                keys[int(offsets[shard]) + low + offset] = sample.key
    held = set(int(r) for r in stand_ins)
    out = []
    for row, shard in zip(rows.tolist(), shards.tolist()):
        entry = {"key": keys[row], "shard": dataset.split_info.shards[shard].path, "row": row}
        if row in held:
            entry["stand_in"] = True
        out.append(entry)
    return out
