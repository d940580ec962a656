"""The one loader type: what every loader of a shardcache dataset offers, whatever makes its batches.

``ShardLoader`` (DataLoader workers over image or feature shards) and ``FeatureBatchLoader`` (in-process batches of
feature rows) differ only in how they make batches; both keep their position in a ``Cursor``
(``shards.position.cursor``) and answer the same methods, so a training loop, a checkpoint
(``state_dict``/``load_state_dict``, which Lightning and accelerate call; ``dcp_state()`` for
``torch.distributed.checkpoint``) or a trainer integration never asks which one it holds (docs/integrations.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shards.errors import InputError
from shards.position.cursor import Cursor
from shards.position.dcp_state import DcpLoaderState
from shards.position.elastic import EXCLUDED
from shards.position.lineage import batch_rows, row_samples
from shards.position.resume import worker_batches


class Loader:
    """What every loader of a shardcache dataset offers, images and features alike: iteration over the epoch's
    batches, ``len`` right for the rank, ``set_epoch``/``epoch`` (also as ``sampler.set_epoch``, Lightning's way),
    ``state_dict``/``load_state_dict`` (the ``Stateful`` protocol Lightning's checkpoints call), ``dcp_state()`` (the
    same for ``torch.distributed.checkpoint``) and ``stage_seconds``. Subclasses say how batches are made; the
    position is the ``cursor``'s (``shards.position.cursor``)."""

    dataset: Any  # a ShardDataset
    batch_size: int
    num_workers: int
    drop_last: bool
    cursor: Cursor

    def __init__(self, dataset: Any, batch_size: int, kind: str, *, num_workers: int, drop_last: bool,
                 split_batch: int):
        if batch_size < 1:
            raise InputError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.cursor = Cursor(dataset, kind, batch_size=batch_size, num_workers=num_workers, drop_last=drop_last,
                             split_batch=split_batch)

    def __len__(self) -> int:
        """Batches of this epoch, counting those handed out before a resume in another layout."""
        return self.cursor.batches_before() + sum(self.batches_per_worker())

    def batches_per_worker(self) -> list[int]:
        """Batches each (logical) worker yields this epoch (of the remainder, in an epoch continued in another
        layout): whole batches, and at most one partial batch per rank."""
        return worker_batches(self.cursor.rank_samples(), self.num_workers, self.batch_size, self.drop_last,
                              self.cursor.split_batch)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def close(self) -> None:
        """Stop what the loader runs beside the caller (worker processes) now, rather than when the garbage
        collector reaches it. Iterating again starts afresh. Also ``with make_loader(...) as loader:``."""

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    @property
    def sampler(self) -> Any:
        """What a trainer that drives a loader like a DataLoader calls ``set_epoch`` on at each epoch's start: the
        dataset, whose epoch decides the order. Lightning's fit loop sets the epoch only through ``loader.sampler``,
        so without this every epoch of ``Trainer.fit`` would repeat epoch 0's order (docs/integrations.md)."""
        return self.dataset

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """The position in the current epoch: after the batches handed out, or after ``batches_consumed`` of them
        when the consumer lags behind (a prefetcher that drew batches the training step has not used); with the
        rows the dataset leaves out (``exclude_rows``), which a resume with others replays (``elastic``)."""
        state = self.cursor.state_dict(batches_consumed)
        if getattr(self.dataset, "excluded", None) is not None:
            state[EXCLUDED] = self.dataset.excluded.tolist()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch at the next batch it had not yet handed out: in the same layout exactly as the
        interrupted run would have, in another (world size, workers, batch size) with exactly the samples the
        interrupted epoch had not yet yielded."""
        self.cursor.load(state)

    def dcp_state(self) -> DcpLoaderState:
        """This loader's position as ``torch.distributed.checkpoint`` saves and loads it (``shards.position.dcp_state``):
        ``dcp.save({"data": loader.dcp_state(), ...})`` on every rank; ``dcp.load`` the same on a run of any world
        size continues the epoch there."""
        return DcpLoaderState(self)

    def batch_keys(self, epoch: int, step: int) -> list[dict[str, Any]]:
        """The samples of batch ``step`` (from 0, within the epoch) of ``epoch`` (from 0, as ``set_epoch``) on this
        rank: ``{"key", "shard", "row"}`` each, ``"stand_in": True`` on a quarantined row (another sample was fed
        in its place). Computed from the order (``shards.position.lineage``), not recorded: an epoch continued from
        a loaded state (in this layout or another) is answered as it was fed while it is the current epoch."""
        remainder = self.cursor.remainder()
        if remainder is not None and remainder.position.epoch == epoch:
            position = remainder.position
        else:
            position = replace(self.cursor.position(0), epoch=epoch, prior=None)
        rows = batch_rows(self.dataset.epoch_source(), position, self.dataset.config.rank, step)
        return row_samples(self.dataset, rows, getattr(self.dataset, "quarantine", None) or ())

    def stage_seconds(self) -> dict[str, float]:
        """This rank's busy seconds per worker stage (``read``, ``decode``, ``transform``, ``collate``), summed over
        its workers and all epochs since the last ``reset_stage_seconds``; a consumer takes differences per epoch."""
        return self.dataset.stage_seconds()

    def reset_stage_seconds(self) -> None:
        self.dataset.reset_stage_seconds()
