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

A saved state is parsed once, where it comes in (``SavedState.parse``: ``load_state_dict``, DCP, the loader's own
restart or mode switch, a run's records): every field of it and of each state it continued
(``resume.check_record``), the rows each layout's stream left out, the quarantine and the resume audit's record
(``shards.position.audit``). It is untrusted input (docs/trust-model.md); past the door only the typed value
travels (to the cursor, this replay, the audit, lineage), and the one way back to a dict is the record a
continuing state saves as its ``prior``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

import numpy as np

from shards.door.shape import as_int_list
from shards.errors import InputError
from shards.order.order import EpochSource, Layout, worker_order
from shards.order.plan import epoch_sizes
from shards.position.audit import AuditRecord, audit_of
from shards.position.resume import LoaderState, check_compatible, check_record, worker_batches, worker_consumed


EXCLUDED = "excluded"  # a saved state's key: the global rows its layout's stream left out
MAX_EXCLUDED = 10_000_000  # rows a state may list (80 MB as int64): more is not a list of bad samples
_FIELDS = tuple(f.name for f in fields(LoaderState))


def excluded_of(record: dict[str, Any], what: str = "loader state excluded") -> np.ndarray | None:
    """The sorted rows a saved state's stream left out (None: none): a saved list checked (``what`` names it), or
    a live dataset's own array."""
    rows = record.get(EXCLUDED)
    if rows is None:
        return None
    if not isinstance(rows, np.ndarray):
        rows = np.asarray(as_int_list(rows, what, max_len=MAX_EXCLUDED, error=InputError), dtype=np.int64)
    return np.unique(rows.astype(np.int64)) if len(rows) else None


@dataclass(frozen=True, eq=False)
class SavedState:
    """One saved state, checked: its ``position`` (the record's fields; ``position.prior`` is the continued state's
    record as saved), the rows its stream left out, the state it continued (``prior``, parsed the same way), its
    quarantine (global row -> key), its resume-audit record (None: none) and ``path``, where it sits in the state
    that was loaded (``"prior."`` per level), which error messages name."""

    position: LoaderState
    excluded: np.ndarray | None = None
    prior: SavedState | None = None
    quarantine: dict[int, str] | None = None
    audit: AuditRecord | None = None
    path: str = ""

    @classmethod
    def parse(cls, state: Any) -> SavedState:
        """``state`` as saved (a dict from ``state_dict``, DCP or a checkpoint) checked once, whole: a field out of
        type or range, a malformed prior, excluded rows or audit record is an ``InputError`` naming it."""
        position = LoaderState(**check_record(state))  # the whole prior chain, each level checked
        return cls._levels(position, state, "", audit_of(state))

    @classmethod
    def of(cls, position: LoaderState, excluded: np.ndarray | None = None) -> SavedState:
        """A position made in code (the loader's own, or one a record's layout describes), over a stream leaving out
        ``excluded``; the states it continued (``position.prior``, as saved) are checked here."""
        prior = None
        if position.prior is not None:
            prior = cls._levels(LoaderState(**check_record(position.prior)), position.prior, "prior.")
        return cls(position, excluded_of({EXCLUDED: excluded}), prior, _quarantine(position))

    @classmethod
    def _levels(cls, position: LoaderState, record: dict[str, Any], path: str,
                audit: AuditRecord | None = None) -> SavedState:
        """A checked level and those below it (``check_record`` checked them all: their fields are taken as is)."""
        prior = None
        if position.prior is not None:
            below = position.prior
            prior = cls._levels(LoaderState(**{name: below[name] for name in _FIELDS}), below, path + "prior.")
        excluded = excluded_of(record, f"loader state {path}excluded")
        return cls(position, excluded, prior, _quarantine(position), audit, path)

    def record(self) -> dict[str, Any]:
        """This state as a continuing state saves it (its ``prior``): the fields and the rows its stream left out."""
        record = self.position.to_dict()
        if self.excluded is not None:
            record[EXCLUDED] = self.excluded.tolist()
        return record


def _quarantine(position: LoaderState) -> dict[int, str]:
    return {int(row): str(key) for row, key in position.quarantined or ()}


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


def continuation(saved: SavedState, current: LoaderState, source: EpochSource) -> Continuation:
    """Check ``saved`` against the loader described by ``current`` and work out how that loader continues it."""
    position = saved.position
    check_compatible(position, current)
    if position.same_layout(current) and _same_rows(saved.excluded, source.excluded):
        here = replace(current, epoch=position.epoch, batches=position.batches, prior=position.prior)
        if saved.prior is None:
            return Continuation(here)  # the bitwise exact path: per-worker skips in the normal plan
        return Continuation(here, without(remaining_after(source, saved.prior), source.excluded))
    here = replace(current, epoch=position.epoch, batches=position.batches, prior=saved.record())
    if position.batches == 0 and position.prior is None:
        return Continuation(replace(here, prior=None))  # nothing consumed: the new layout's whole epoch
    return Continuation(here, without(remaining_after(source, saved), source.excluded))


def remaining_after(source: EpochSource, saved: SavedState) -> np.ndarray:
    """Global indices of the samples of ``saved``'s epoch that no rank had yielded (nor its layouts left out), in
    the epoch's order."""
    gone, rows = _replay(source, saved)
    return rows[~gone]


def _replay(source: EpochSource, saved: SavedState) -> tuple[np.ndarray, np.ndarray]:
    """(a mask over the epoch's stream positions yielded or left out up to ``saved``, the epoch's rows in stream
    order), following its ``prior`` levels (at most ``MAX_PRIOR_DEPTH``, checked at the door). Positions, not rows:
    a mixture may read a row twice in one epoch, once per pass. A batch count beyond what the saved layout's epoch
    had is refused, naming the field: clamped, it would resume from a position no run was at."""
    state, path = saved.position, saved.path
    if saved.prior is None:
        rows = replace(source, excluded=saved.excluded).epoch_stream(state.epoch, state.world_size, state.node_count)
        consumed = np.zeros(len(rows), dtype=bool)
    else:
        consumed, rows = _replay(source, saved.prior)
        if saved.excluded is not None:
            consumed |= np.isin(rows, saved.excluded)
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
