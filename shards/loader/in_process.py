"""Run mode ``InProcess``: batches made in the training process, with no worker processes.

Over feature shards the batches are gathered whole (``FeatureBatches``): features are small and per-sample Python
overhead, not the disk, is the limit (a DataLoader worker copying batches between processes made a linear-head
epoch 3-6x slower), so the rank's rows become one index tensor, permuted fully, and each batch is one gather of
``features[B, D]`` rows from the split's ``FeatureStore`` (``shards.stream.feature_store``). A whole permutation makes
the first batch read every shard, so a cold first epoch waits for the whole table; a windowed order
(``Sampling.feature_window``) reads a few shards per window, and a background thread
(``shards.loader.feature_prefetch``) gathers the next window while this one trains.

Over image shards the per-sample stream is decoded in the main process by a DataLoader without workers
(``shards.loader.worker_processes.DataLoaderRun`` with none): for debugging, tests and tiny datasets.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from shards.loader.base import Loader, Run, RunMode
from shards.procs.torch_private import pin_nested
from shards.loader.budget import feature_row_bytes, fit_depth, split_budget
from shards.loader.feature_prefetch import WindowsAhead, joined
from shards.procs.stage_times import READ
from shards.loader.worker_processes import DataLoaderRun
from shards.procs.values import MAX_WORKERS
from shards.position.resume import FEATURE_BATCHES, STREAM

IN_PROCESS_SLOT = MAX_WORKERS  # the stage-seconds row of the process that iterates without workers


@dataclass(frozen=True)
class InProcess(RunMode):
    """Run mode: no worker processes; a feature table's batches are gathered whole, an image dataset's samples
    decoded one by one in the main process. Nothing runs beside the loop, so there is nothing a ``StallPolicy``
    could restart: asking for one is an error (``RunMode.supervise``).

    Which of the two runs a dataset gets is the dataset's to say (``ready_rows``: its rows are already the model's
    input, so a batch is one gather), not a check of its class here."""

    kind = "in-process"

    @staticmethod
    def gathers(dataset: Any) -> bool:
        """Whether this mode gathers ``dataset``'s batches whole (ready rows) rather than collating samples."""
        return bool(dataset.ready_rows)

    def layout(self, dataset: Any, batch_size: int) -> tuple[str, int]:
        # Gathered batches count positions in one full permutation; a stream splits in whole batches.
        return (FEATURE_BATCHES, 1) if self.gathers(dataset) else (STREAM, batch_size)

    def start(self, loader: Loader) -> Run:
        return FeatureBatches(loader) if self.gathers(loader.dataset) else DataLoaderRun(loader, 0)


class FeatureBatches(Run):
    """In-process batches ``(features[B, D], labels[B])`` (plus ``keys`` with ``return_keys``) for one rank; for a
    regression table ``(features[B, D], targets[B])``, float32.

    Order: the rank's rows (``shards.order.order``, equal counts on every rank, class-weighted draws included),
    permuted from ``(seed, epoch, rank)``: whole, or within windows of
    ``feature_window`` rows, each gathered one window ahead on a background thread (batches are then slices of
    a window's block). The cursor counts batches, so a resumed run yields exactly the batches the interrupted
    epoch had left; with another world size or batch size, exactly the rows it had left, dealt to the new ranks
    (``shards.position.elastic``).

    Stage seconds: the seconds spent planning the epoch's rows and gathering batches (loading shards on first use
    included) count as read, the one worker stage an in-process loader of ready rows has; with a window, the
    seconds the caller waited for a window still being gathered (the gathering that overlapped training is not
    counted: it made no one wait).
    """

    def __init__(self, loader: Loader):
        # A proxy, not the loader: the loader holds its run, and a cycle between them would leave a dropped
        # loader to the cyclic collector, which may finalise torch's queues before the workers hear to stop
        # (each then waits out torch's 5 s join); without the cycle, dropping the loader frees it at once.
        self.loader = weakref.proxy(loader)
        self.dataset = loader.dataset
        self.store = loader.dataset.feature_store()
        self.ahead_within_budget(0)  # a budget below one batch beside the windows is refused now, not at a batch

    def ahead_within_budget(self, asked: int) -> int:
        """Batches a consumer may prefetch beside the one handed out and the windows gathered ahead (the one
        served and the next: ``BudgetParts.windows``), within the loader's budget; refused when not even the
        one batch fits (the window is part of the order: it cannot shrink)."""
        loader = self.loader
        row = feature_row_bytes(self.dataset)
        if loader.memory is None or row is None:
            return asked
        window = self.dataset.config.feature_window
        windows = split_budget(loader.memory, windows=2 * window * row if window else 0).windows
        # beside the queue: the batch the loop trains on and the one the prefetch thread holds while it is full
        return min(asked, fit_depth(loader.memory, loader.batch_size * row, 1, max(1, asked), 2, loader.mode,
                                    windows))

    def _batches(self, rows: int) -> int:
        size = self.loader.batch_size
        return rows // size if self.loader.drop_last else -(-rows // size)

    def epoch_rows(self, epoch: int, left: np.ndarray | None = None) -> torch.Tensor:
        """Global row indices of this rank's epoch, in the order they are served (``left``: the rows an epoch
        continued in another layout has left)."""
        order = self.dataset.worker_order(epoch, 0, 1, left=left, whole=True)  # class weights drawn there
        return torch.from_numpy(order.served().astype(np.int64))

    def batches(self) -> Iterator[tuple]:
        cursor, size, times = self.loader.cursor, self.loader.batch_size, self.loader.stage_times
        audit = self.loader.audit
        epoch = self.dataset.epoch
        continued = cursor.begin()
        start = continued.position.layout_batches if continued is not None else 0
        before = cursor.batches_before()
        clock = time.perf_counter if times is not None else None
        began = clock() if clock else 0.0
        rows = self.epoch_rows(epoch, continued.left if continued is not None else None)
        window = self.dataset.config.feature_window
        pin = self.loader.pin_memory and torch.cuda.is_available()  # asked for: make_loader's default is False here
        gather = self.store.rows
        ahead = WindowsAhead(lambda a, b: gather(rows[a:b]), len(rows), window) if window else None
        try:
            for batch in range(start, self._batches(len(rows))):
                first, stop = batch * size, min((batch + 1) * size, len(rows))
                out = tuple(joined(ahead.pieces(first, stop)) if ahead is not None else gather(rows[first:stop]))
                if pin:
                    out = tuple(pin_nested(list(out)))
                if audit is not None:
                    audit.gathered(rows[first:stop])  # what the batch was gathered from (``resume_audit``)
                cursor.handed = before + batch + 1
                if clock:
                    times.add_one(IN_PROCESS_SLOT, READ, clock() - began)
                yield out
                if clock:
                    began = clock()
            if clock:
                times.add_one(IN_PROCESS_SLOT, READ, clock() - began)
        finally:  # finished, raised, or dropped by the caller: the read-ahead thread ends with the epoch
            if ahead is not None:
                ahead.close()
