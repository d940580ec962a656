"""Elastic resume: which samples an interrupted epoch had left, replayed from its saved layout without reading a shard.

A saved state holds a batch count and the layout that produced it (world size, node count, workers, batch size,
drop_last). Every rank consumed the same number of batches, and DataLoader's round robin tells how many samples
each worker of each rank had consumed (``shards.position.resume``). Each worker's stream is a pure function of the
plan and the seeded shuffle buffer, and the buffer permutes positions without looking at the samples
(``order.buffer_positions``, numpy index arithmetic), so running it over global sample indices instead of samples
replays, exactly, which samples every old worker yielded, in a fraction of a second at ImageNet size.

The samples left (the epoch's samples minus every one yielded, in the epoch's shard order) are then dealt to the
new layout exactly as a whole epoch is dealt (``plan.share_of``): equal rank shares, padded by repeating their
first samples or, with the dataset's ``drop_last``, fewer than ``world_size`` of them left out; whole-batch worker
runs. Later epochs follow the new layout's plan. The node count belongs to the layout: with node affinity
(``plan.shard_order``) it decides the shard order, so the old stream is rebuilt with the saved count; the
remainder keeps that stream's order (node by node, so an unchanged node count stays mostly node-local) and is
dealt as any remainder; the next epoch is node-local again. With class weights the epoch's stream is its weighted
draws (``shards.order.weights``, from the labels of the column index), so the replay marks stream positions, not
rows: the remainder is exactly the draws not yet yielded, a row drawn twice and yielded once still left once.

Rows left out of the stream (``ShardDataset.exclude_rows``) may be added when resuming: a saved state records the
rows its layout's stream left out (``"excluded"``, beside the state's fields, and so in each ``prior``), the replay
drops each layout's own, and a resume with other excluded rows continues over the rows left minus the new ones, as
a layout change does: the rest of the epoch drops them and nothing else, in the order it had.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from shards.errors import InputError
from shards.door.shape import as_int_list
from shards.order.order import EpochSource, Layout, worker_order
from shards.order.plan import epoch_sizes
from shards.position.resume import LoaderState, check_compatible, worker_batches, worker_consumed

LAYOUT_FIELDS = ("world_size", "num_workers", "batch_size", "drop_last")
EXCLUDED = "excluded"  # a saved state's key: the global rows its layout's stream left out
MAX_EXCLUDED = 10_000_000  # rows a state may list (80 MB as int64): more is not a list of bad samples


def excluded_of(record: dict[str, Any], what: str = "loader state excluded") -> np.ndarray | None:
    """The sorted rows a saved state's stream left out (None: none): a saved list checked (``what`` names it), or
    a live dataset's own array (``lineage``)."""
    rows = record.get(EXCLUDED)
    if rows is None:
        return None
    if not isinstance(rows, np.ndarray):
        rows = np.asarray(as_int_list(rows, what, max_len=MAX_EXCLUDED, error=InputError), dtype=np.int64)
    return np.unique(rows.astype(np.int64)) if len(rows) else None


def without(rows: np.ndarray, excluded: np.ndarray | None) -> np.ndarray:
    """``rows`` in their order, less ``excluded``."""
    return rows if excluded is None else rows[~np.isin(rows, excluded)]


def _same_rows(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))


def dataset_fingerprint(shard_sizes: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([int(n) for n in shard_sizes]).encode()).hexdigest()[:16]


def sampling_settings(config: Any) -> dict[str, Any]:
    """The settings besides the seed that decide sample order, as saved in a state."""
    weights = None if config.class_weights is None else [float(w) for w in config.class_weights]
    settings = {"shuffle": bool(config.shuffle), "shuffle_buffer": int(config.shuffle_buffer), "class_weights": weights,
                "drop_last": bool(config.drop_last)}
    # The rotation of node affinity is an order setting of the run, not of the hardware it runs on (the node count,
    # which may change, is in the layout): a resume with another rotation is refused, as for another shuffle. It is
    # recorded only when set, so that states saved before it existed (never rotating) still compare equal.
    if config.rotate_every:
        settings["rotate_every"] = int(config.rotate_every)
    if config.feature_window:  # likewise: recorded only when set
        settings["feature_window"] = int(config.feature_window)
    return settings


@dataclass(frozen=True)
class Continuation:
    """How a loader continues a saved state: its position (the current layout at the saved epoch and batch
    count, ``prior`` set when the epoch is a remainder) and, for a remainder, the epoch's rows left, in stream
    order: the stream ``worker_order`` deals to the new layout."""

    position: LoaderState
    left: np.ndarray | None = None

    @property
    def batches_before(self) -> int:
        """Batches the epoch had handed out before its current layout took over (0 unless a remainder)."""
        return self.position.batches - self.position.layout_batches


def continuation(state: dict[str, Any], current: LoaderState, source: EpochSource) -> Continuation:
    """Check ``state`` against the loader described by ``current`` and work out how that loader continues it."""
    saved = LoaderState.from_dict(state)
    check_compatible(saved, current)
    saved = replace(saved, **{f: getattr(current, f) for f in LAYOUT_FIELDS if getattr(saved, f) is None})
    record = saved.to_dict()  # the saved layout, with the rows it left out
    if state.get(EXCLUDED) is not None:
        record[EXCLUDED] = state[EXCLUDED]
    if saved.same_layout(current) and _same_rows(excluded_of(state), source.excluded):
        position = replace(current, epoch=saved.epoch, batches=saved.batches, prior=saved.prior)
        if saved.prior is None:
            return Continuation(position)  # the bitwise exact path: per-worker skips in the normal plan
        return Continuation(position, without(remaining_after(source, saved.prior, "prior."), source.excluded))
    position = replace(current, epoch=saved.epoch, batches=saved.batches, prior=record)
    if saved.batches == 0 and saved.prior is None:
        return Continuation(replace(position, prior=None))  # nothing consumed: the new layout's whole epoch
    return Continuation(position, without(remaining_after(source, record), source.excluded))


def remaining_after(source: EpochSource, state: LoaderState | dict[str, Any], path: str = "") -> np.ndarray:
    """Global indices of the samples of saved ``state``'s epoch that no rank had yielded (nor its layouts left
    out), in the epoch's order; ``state`` as saved (a dict, with the rows it left out: checked, ``path`` naming
    where it sits in the state being loaded) or a ``LoaderState``."""
    if isinstance(state, LoaderState):
        gone, rows = _replay(source, state, None, path)
    else:
        gone, rows = _replay(source, LoaderState.from_dict(state), excluded_of(state, f"loader state {path}excluded"),
                             path)
    return rows[~gone]


def _replay(source: EpochSource, state: LoaderState, excluded: np.ndarray | None,
            path: str) -> tuple[np.ndarray, np.ndarray]:
    """(a mask over the epoch's stream positions yielded or left out up to saved ``state``, the epoch's rows in
    stream order), following ``prior`` links (``LoaderState.from_dict`` bounds their depth). Positions, not rows:
    a mixture may read a row twice in one epoch, once per pass. A batch count beyond what the saved layout's epoch
    had is refused, naming the field: clamped, it would resume from a position no run was at."""
    if state.prior is None:
        rows = replace(source, excluded=excluded).epoch_stream(state.epoch, state.world_size, state.node_count)
        consumed = np.zeros(len(rows), dtype=bool)
    else:
        prior = path + "prior."
        consumed, rows = _replay(source, LoaderState.from_dict(state.prior),
                                 excluded_of(state.prior, f"loader state {prior}excluded"), prior)
        if excluded is not None:
            consumed |= np.isin(rows, excluded)
    stream = np.flatnonzero(~consumed).astype(np.int64)
    layout = Layout.of(state)
    per_rank = epoch_sizes(len(stream), state.world_size, source.drop_last).per_rank
    had = sum(worker_batches(per_rank, state.logical_workers, state.batch_size, state.drop_last,
                             state.split_batch or 1))
    if state.layout_batches > had:
        raise InputError(f"loader state {path}batches is {state.batches}: epoch {state.epoch} had "
                         f"{state.batches - state.layout_batches + had} batches in the layout that saved it")
    counts, _ = worker_consumed(per_rank, state)
    for worker, count in enumerate(counts):
        if count:  # a worker that yielded nothing marks nothing, on any rank
            for rank in range(state.world_size):
                consumed[worker_order(source, layout, state.epoch, rank, worker, stream).yielded(count)] = True
    return consumed, rows
