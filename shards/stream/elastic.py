"""Elastic resume: which samples an interrupted epoch had left, replayed from its saved layout without reading a shard.

A saved state holds a batch count and the layout that produced it (world size, node count, workers, batch size,
drop_last). Every rank consumed the same number of batches, and DataLoader's round robin tells how many samples
each worker of each rank had consumed (``shards.stream.resume``). Each worker's stream is a pure function of the
plan and the seeded shuffle buffer, and the buffer permutes positions without looking at the samples (``stages``),
so running it over global sample indices instead of samples replays, exactly, which samples every old worker
yielded.

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
import itertools
import json
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from shards.errors import InputError
from shards.stream.plan import STREAM_SHUFFLE_BUFFER, epoch_sizes, epoch_stream, rng_for, share_of
from shards.stream.resume import FEATURE_BATCHES, LoaderState, check_compatible, worker_consumed
from shards.stream.stages import shuffle_buffer

LAYOUT_FIELDS = ("world_size", "num_workers", "batch_size", "drop_last")


@dataclass(frozen=True)
class EpochSource:
    """What every layout of a run shares: the shard sizes and the order settings."""

    shard_sizes: tuple[int, ...]
    seed: int
    shuffle: bool
    shuffle_buffer: int
    drop_last: bool  # the dataset's: equal rank shares by leaving samples out rather than padding
    class_weights: bool
    rotate_every: int = 0  # node affinity's rotation; the node count comes from each state's layout
    mixture: Any = field(default=None, compare=False)  # a ``Mixture``: its own epoch rows (shards.stream.mixture)

    @classmethod
    def of(cls, config: Any, shard_sizes: Sequence[int], mixture: Any = None) -> EpochSource:
        """From a ``StreamConfig``."""
        return cls(tuple(int(n) for n in shard_sizes), config.seed, config.shuffle, config.shuffle_buffer,
                   config.drop_last, config.class_weights is not None, config.rotate_every, mixture)

    def epoch_rows(self, epoch: int, world_size: int, nodes: int) -> np.ndarray:
        """The epoch's rows in stream order, before rank padding: what the plan of that layout deals out."""
        if self.mixture is not None:
            return self.mixture.stream(epoch)
        return epoch_stream(self.shard_sizes, seed=self.seed, epoch=epoch, world_size=world_size,
                            drop_last=self.drop_last, shuffle=self.shuffle, nodes=nodes,
                            rotate_every=self.rotate_every)


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
    return settings


@dataclass(frozen=True)
class Continuation:
    """How a loader continues a saved state: its position (the current layout at the saved epoch and batch
    count, ``prior`` set when the epoch is a remainder) and, for a remainder, this rank's samples in order."""

    position: LoaderState
    rank_indices: np.ndarray | None = None


def continuation(state: dict[str, Any], current: LoaderState, source: EpochSource, rank: int) -> Continuation:
    """Check ``state`` against the loader described by ``current`` and work out how that loader continues it."""
    saved = LoaderState.from_dict(state)
    check_compatible(saved, current)
    saved = replace(saved, **{f: getattr(current, f) for f in LAYOUT_FIELDS if getattr(saved, f) is None})
    if saved.same_layout(current):
        position = replace(current, epoch=saved.epoch, batches=saved.batches, prior=saved.prior)
        if saved.prior is None:
            return Continuation(position)  # the bitwise exact path: per-worker skips in the normal plan
        left = remaining_after(source, saved.prior_state)
        return Continuation(position, rank_share(left, current, source, rank))
    if source.class_weights:
        raise InputError(f"the saved state's layout (world_size, num_workers, batch_size, drop_last, nodes) "
                         f"{_shown(saved)} differs from this loader's {_shown(current)}, and class-weighted "
                         "sampling resumes in the same layout only")
    position = replace(current, epoch=saved.epoch, batches=saved.batches, prior=saved.to_dict())
    if saved.batches == 0 and saved.prior is None:
        return Continuation(replace(position, prior=None))  # nothing consumed: the new layout's whole epoch
    return Continuation(position, rank_share(remaining_after(source, saved), current, source, rank))


def _shown(state: LoaderState) -> tuple:
    """The layout fields a user sets, for messages (the split unit follows from the batch size)."""
    return (*state.layout()[:4], state.node_count)


def rank_share(left: np.ndarray, current: LoaderState, source: EpochSource, rank: int) -> np.ndarray:
    """This rank's part of the samples left, as the new layout deals them (workers split it further)."""
    return share_of(left, rank=rank, world_size=current.world_size, drop_last=source.drop_last)


def remaining_after(source: EpochSource, state: LoaderState) -> np.ndarray:
    """Global indices of the samples of ``state``'s epoch that no rank had yielded, in the epoch's order."""
    consumed, rows = _replay(source, state)
    return rows[~consumed]


def _replay(source: EpochSource, state: LoaderState) -> tuple[np.ndarray, np.ndarray]:
    """(a mask over the epoch's stream positions yielded up to ``state``, the epoch's rows in stream order),
    following ``prior`` links. Positions, not rows: a mixture may read a row twice in one epoch, once per pass."""
    prior = state.prior_state
    if prior is None:
        rows = source.epoch_rows(state.epoch, state.world_size, state.node_count)
        consumed = np.zeros(len(rows), dtype=bool)
        stream = np.arange(len(rows), dtype=np.int64)
    else:
        consumed, rows = _replay(source, prior)
        stream = np.flatnonzero(~consumed).astype(np.int64)
    for rank in range(state.world_size):
        for positions in yielded(source, state, stream, rank):
            consumed[positions] = True
    return consumed, rows


def yielded(source: EpochSource, state: LoaderState, stream: np.ndarray, rank: int) -> list[np.ndarray]:
    """The samples each logical worker of ``rank`` had yielded in ``state``'s layout, dealt from ``stream``."""
    per_rank = epoch_sizes(len(stream), state.world_size, source.drop_last).per_rank
    if state.kind == FEATURE_BATCHES:  # one in-process stream, fully permuted per rank
        rows = share_of(stream, rank=rank, world_size=state.world_size, drop_last=source.drop_last)
        (count,), _ = worker_consumed(per_rank, replace(state, num_workers=0, split_batch=1))
        return [permuted_rows(rows, source, state.epoch, rank)[:count]]
    counts, _ = worker_consumed(per_rank, state)
    workers, split = state.logical_workers, state.split_batch or 1
    out = []
    for worker, count in enumerate(counts):
        indices = share_of(stream, rank=rank, world_size=state.world_size, worker=worker, num_workers=workers,
                           drop_last=source.drop_last, batch_size=split)
        if source.shuffle and count:
            rng = rng_for(source.seed, STREAM_SHUFFLE_BUFFER, state.epoch, rank, worker)
            indices = np.fromiter(itertools.islice(shuffle_buffer(indices.tolist(), source.shuffle_buffer, rng),
                                                   count), dtype=np.int64, count=count)
        out.append(indices[:count])
    return out


def permuted_rows(rows: np.ndarray, source: EpochSource, epoch: int, rank: int) -> np.ndarray:
    """The feature loader's order: the rank's rows fully permuted from (seed, epoch, rank)."""
    if not source.shuffle:
        return rows
    return rows[rng_for(source.seed, STREAM_SHUFFLE_BUFFER, epoch, rank, 0).permutation(len(rows))]
