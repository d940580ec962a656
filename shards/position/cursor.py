"""A loader's cursor: where it is in its run, the one owner of run-time position (docs/design.md, "Resume").

Every loader (``shards.loader.base.Loader``, whatever its run mode, and a ``ShardDataset`` iterated on its own, which
is its own loader of one worker and batches of one sample) owns one ``Cursor``. It counts the batches handed out in
the current epoch, holds a loaded state until the iteration it applies to starts, keeps the quarantine (the samples
left out of every epoch, ``shards.loader.watchdog``), and answers everything a saved record says (the batches an
epoch had handed out before a layout change, the rows it has left) through the ``SavedState`` the door parsed
(``shards.position.elastic``) and ``Continuation``, never by reading the record's fields by hand. The dataset keeps only what its worker copies must share with every
loader over it (the epoch to stream, the skipped count); the order itself is ``shards.order.order``.

The quarantine reaches DataLoader workers the way the epoch does: a block of shared integers
(``shared_blocks.SharedQuarantine``) each worker reads when it starts an epoch. ``keep_out`` is its one writer, for a
loaded state and the watchdog alike, so two loaders over one dataset never share a quarantine.
"""

from __future__ import annotations

from typing import Any

from shards.errors import InputError
from shards.position.elastic import Continuation, SavedState, continuation, dataset_fingerprint, sampling_settings
from shards.order.plan import epoch_sizes
from shards.position.resume import LoaderState, consumed_batches, quarantine_record, stream_resume, worker_batches
from shards.position.shared_blocks import Resume, SharedQuarantine, check_quarantine_size


class Cursor:
    """The position of a loader of ``kind`` over ``dataset`` in one layout (batch size, workers, split unit)."""

    def __init__(self, dataset: Any, kind: str, *, batch_size: int, num_workers: int, drop_last: bool,
                 split_batch: int):
        self.dataset = dataset
        self.kind = kind
        self.batch_size, self.num_workers, self.drop_last, self.split_batch = (batch_size, num_workers, drop_last,
                                                                              split_batch)
        self.handed = 0  # batches handed out in the current epoch, those before a layout change included
        self._pending: Continuation | None = None  # a loaded state, for the next iteration only
        self._active: Continuation | None = None  # the current iteration's continuation of a remainder
        self.quarantine: dict[int, str] = {}  # global row -> key, never decoded again (``keep_out``)
        self.shared_quarantine = SharedQuarantine()  # the rows of ``quarantine``, as workers read them

    # -- saving and loading ----------------------------------------------------------------------------------------
    def position(self, batches: int, prior: dict[str, Any] | None = None) -> LoaderState:
        """A position over the dataset in this cursor's layout, with the settings a resume is checked against."""
        d = self.dataset
        c = d.config
        fingerprint = d.mixture.fingerprint if d.mixture is not None else dataset_fingerprint(d.shard_sizes)
        return LoaderState(self.kind, d.epoch, batches, batch_size=self.batch_size, num_workers=self.num_workers,
                           drop_last=self.drop_last, seed=c.seed, world_size=c.world_size,
                           split_batch=self.split_batch, dataset=fingerprint, sampling=sampling_settings(c),
                           prior=prior, nodes=c.nodes, quarantined=quarantine_record(self.quarantine) or None)

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """The position after the batches handed out, or after ``batches_consumed`` of them when the consumer lags
        behind (a prefetcher that drew batches the training step has not used)."""
        remainder = self.remainder()
        prior = remainder.position.prior if remainder is not None else None
        return self.position(consumed_batches(batches_consumed, self.handed), prior).to_dict()

    def load(self, saved: SavedState) -> Continuation:
        """Continue ``saved`` from the next iteration on: bitwise exactly in the same layout, over the rows its epoch
        had left in another (``shards.position.elastic``). Everything is checked before anything changes: the state's
        fields (at the door, ``SavedState.parse``), its batch count against the epoch's batches, its quarantined rows
        against the split."""
        return self.apply(self.checked(saved))

    def checked(self, saved: SavedState) -> tuple[Continuation, dict[int, str]]:
        """``load``'s checks of ``saved``, nothing changed: how this cursor continues it, and its quarantine."""
        continued = continuation(saved, self.position(0), self.dataset.epoch_source())
        position, had = continued.position, self.epoch_batches(continued)
        if position.layout_batches > had:  # refused, not clamped: no run was ever at that position
            raise InputError(f"loader state batches is {position.batches}: epoch {position.epoch} has "
                             f"{continued.batches_before + had} batches in this layout")
        quarantine = saved.quarantine or {}
        rows = sum(self.dataset.shard_sizes)
        if quarantine and max(quarantine) >= rows:
            raise InputError(f"loader state quarantined row {max(quarantine)} is not a row of this split ({rows} rows)")
        check_quarantine_size(len({**self.quarantine, **quarantine}))  # before anything changes
        return continued, quarantine

    def apply(self, checked: tuple[Continuation, dict[int, str]]) -> Continuation:
        """Continue a state ``checked`` found good from the next iteration on."""
        continued, saved = checked
        self.keep_out(saved)
        self._pending = continued
        self.handed = continued.position.batches
        self.dataset.set_epoch(continued.position.epoch)
        return continued

    def keep_out(self, samples: dict[int, str]) -> None:
        """Quarantine ``samples`` (global row -> key) from the next epoch a worker starts on: the one place the
        quarantine changes (a loaded state, the watchdog, a lineage replay of a run's quarantine events)."""
        if not samples:
            return
        quarantine = {**self.quarantine, **samples}
        check_quarantine_size(len(quarantine))
        self.shared_quarantine.write(sorted(quarantine))
        self.quarantine = quarantine

    @property
    def quarantined(self) -> tuple[tuple[int, str], ...]:
        """The quarantine as sorted ``(global row, key)`` pairs."""
        return tuple(sorted(self.quarantine.items()))

    # -- one iteration ---------------------------------------------------------------------------------------------
    def begin(self) -> Continuation | None:
        """Start an iteration of the dataset's current epoch: the loaded state that continues it, if any."""
        pending, self._pending = self._pending, None
        continued = pending if pending is not None and pending.position.epoch == self.dataset.epoch else None
        self._active = continued if continued is not None and continued.left is not None else None
        self.handed = continued.position.batches if continued is not None else 0
        return continued

    def upcoming(self) -> int:
        """The batch of the current epoch the next iteration starts at: a loaded state's position, else 0."""
        pending = self._pending
        return pending.position.batches if pending is not None and pending.position.epoch == self.dataset.epoch \
            else 0

    def remainder(self) -> Continuation | None:
        """The continuation whose remainder the current (or next) iteration of this epoch reads, if any."""
        continued = self._pending if self._pending is not None else self._active
        if continued is not None and continued.left is not None and continued.position.epoch == self.dataset.epoch:
            return continued
        return None

    def batches_before(self) -> int:
        """Batches this epoch handed out before its current layout took over (0 unless it continues a remainder)."""
        remainder = self.remainder()
        return remainder.batches_before if remainder is not None else 0

    def rank_samples(self) -> int:
        """Samples this rank reads in the current epoch (of the remainder, in an epoch continued in another layout)."""
        return self._samples(self.remainder())

    def _samples(self, continued: Continuation | None) -> int:
        if continued is None or continued.left is None:
            return len(self.dataset)
        c = self.dataset.config
        return epoch_sizes(len(continued.left), c.world_size, c.drop_last).per_rank

    def epoch_batches(self, continued: Continuation | None) -> int:
        """Batches this rank's epoch has in this cursor's layout (of the remainder, when ``continued`` is one)."""
        return sum(worker_batches(self._samples(continued), self.num_workers, self.batch_size, self.drop_last,
                                  self.split_batch))

    def resume(self, continued: Continuation | None) -> Resume | None:
        """What each worker skips to continue ``continued`` (from ``begin``), and which worker goes first."""
        if continued is None:
            return None
        return stream_resume(continued.position, self.rank_samples(), remainder=continued.left is not None)
