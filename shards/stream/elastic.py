"""Elastic resume: which samples an interrupted epoch had left, replayed from its saved layout without reading a shard.

A saved state holds a batch count and the layout that produced it (world size, node count, workers, batch size,
drop_last). Every rank consumed the same number of batches, and DataLoader's round robin tells how many samples
each worker of each rank had consumed (``shards.stream.resume``). Each worker's stream is a pure function of the
plan and the seeded shuffle buffer, and the buffer permutes positions without looking at the samples
(``order.buffer_positions``, numpy index arithmetic), so running it over global sample indices instead of samples
replays, exactly, which samples every old worker yielded, in a fraction of a second at ImageNet size.

The samples left (the epoch's samples minus every one yielded, in the epoch's shard order) are then dealt to the
new layout exactly as a whole epoch is dealt (``plan.share_of``): equal rank shares, padded by repeating their
first samples or, with the dataset's ``drop_last``, fewer than ``world_size`` of them left out; whole-batch worker
runs. Later epochs follow the new layout's plan. The node count belongs to the layout: with node affinity
(``plan.shard_order``) it decides the shard order, so the old stream is rebuilt with the saved count; the
remainder keeps that stream's order (node by node, so an unchanged node count stays mostly node-local) and is
dealt as any remainder; the next epoch is node-local again. Class-weighted resampling draws from labels, which are
only known by reading the shards, and repeats samples, so such a run resumes in the same layout only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from shards.errors import InputError
from shards.stream.order import EpochSource, Layout, worker_order
from shards.stream.plan import epoch_sizes
from shards.stream.resume import LoaderState, check_compatible, worker_consumed

LAYOUT_FIELDS = ("world_size", "num_workers", "batch_size", "drop_last")


def dataset_fingerprint(shard_sizes: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps([int(n) for n in shard_sizes]).encode()).hexdigest()[:16]


def sampling_settings(config: Any) -> dict[str, Any]:
    """The settings besides the seed that decide sample order, as saved in a state."""
    weights = None if config.class_weights is None else [float(w) for w in config.class_weights]
    settings = {"shuffle": bool(config.shuffle), "shuffle_buffer": int(config.shuffle_buffer), "class_weights": weights,
                "weight_window": int(config.weight_window), "drop_last": bool(config.drop_last)}
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
    if saved.same_layout(current):
        position = replace(current, epoch=saved.epoch, batches=saved.batches, prior=saved.prior)
        if saved.prior is None:
            return Continuation(position)  # the bitwise exact path: per-worker skips in the normal plan
        return Continuation(position, remaining_after(source, saved.prior_state))
    if source.class_weights:
        raise InputError(f"the saved state's layout (world_size, num_workers, batch_size, drop_last, nodes) "
                         f"{_shown(saved)} differs from this loader's {_shown(current)}, and class-weighted "
                         "sampling resumes in the same layout only")
    position = replace(current, epoch=saved.epoch, batches=saved.batches, prior=saved.to_dict())
    if saved.batches == 0 and saved.prior is None:
        return Continuation(replace(position, prior=None))  # nothing consumed: the new layout's whole epoch
    return Continuation(position, remaining_after(source, saved))


def _shown(state: LoaderState) -> tuple:
    """The layout fields a user sets, for messages (the split unit follows from the batch size)."""
    return (*state.layout()[:4], state.node_count)


def remaining_after(source: EpochSource, state: LoaderState) -> np.ndarray:
    """Global indices of the samples of ``state``'s epoch that no rank had yielded, in the epoch's order."""
    consumed, rows = _replay(source, state)
    return rows[~consumed]


def _replay(source: EpochSource, state: LoaderState) -> tuple[np.ndarray, np.ndarray]:
    """(a mask over the epoch's stream positions yielded up to ``state``, the epoch's rows in stream order),
    following ``prior`` links. Positions, not rows: a mixture may read a row twice in one epoch, once per pass."""
    prior = state.prior_state
    if prior is None:
        rows = source.epoch_stream(state.epoch, state.world_size, state.node_count)
        consumed = np.zeros(len(rows), dtype=bool)
        stream = np.arange(len(rows), dtype=np.int64)
    else:
        consumed, rows = _replay(source, prior)
        stream = np.flatnonzero(~consumed).astype(np.int64)
    layout = Layout.of(state)
    per_rank = epoch_sizes(len(stream), state.world_size, source.drop_last).per_rank
    counts, _ = worker_consumed(per_rank, state)
    for rank in range(state.world_size):
        for worker, count in enumerate(counts):
            consumed[worker_order(source, layout, state.epoch, rank, worker, stream).yielded(count)] = True
    return consumed, rows
