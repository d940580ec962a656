"""Reading ahead for the in-process feature loader: the next window is gathered while the current window trains.

With a windowed order (``Sampling.feature_window``, ``shards.order.order``) the rows of window ``k`` (served
positions ``[k * window, (k + 1) * window)``) live in a few shards. ``WindowsAhead`` gathers each window into one
block in served order (loading its shards: file reads, sha256 and ``torch.load`` on a cold epoch, which release
the GIL) on one background thread, one window ahead of the batches, so a batch is a slice of a ready block and
the training thread neither reads files nor indexes shards. At most two windows are held beyond what the dataset
itself keeps (``cache="memory"`` keeps every shard it loaded).

The thread is owned by one epoch's iteration: ``close()`` (called when the iterator finishes, raises or is
dropped) cancels what has not started, waits for the one gather in progress and ends the thread. A load that
fails raises its own error (a ``CorruptDataError`` naming the shard) in the training thread, at the batch that
needs it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

THREAD_NAME = "shardcache-feature-prefetch"

Block = Sequence[Any]  # one window's parts in served order: (features, values) or (features, values, keys)


class WindowsAhead:
    """The blocks of a served order's windows, gathered one window ahead of the batches asking for them.

    ``gather``: served positions ``[start, stop)`` -> their block (the loader's gather over the dataset's shards);
    ``positions``: how many the epoch serves; ``window``: positions per window (the order's ``feature_window``)."""

    def __init__(self, gather: Callable[[int, int], Block], positions: int, window: int):
        self._gather = gather
        self._positions = positions
        self._window = window
        self._blocks: dict[int, Future] = {}
        self._executor: ThreadPoolExecutor | None = None

    def pieces(self, start: int, stop: int) -> list[Block]:
        """Positions ``[start, stop)`` as slices of their windows' blocks (two for a batch across a window's end),
        waiting for a block still being gathered; starts the window after the last one asked for and lets go of
        the windows before the first."""
        first, last = start // self._window, (stop - 1) // self._window
        self._blocks = {k: block for k, block in self._blocks.items() if k >= first}
        for k in range(first, min(last + 1, (self._positions - 1) // self._window) + 1):
            if k not in self._blocks:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
                begin = k * self._window
                self._blocks[k] = self._executor.submit(self._gather, begin,
                                                        min(begin + self._window, self._positions))
        out = []
        for k in range(first, last + 1):
            begin = k * self._window
            lo, hi = max(start, begin) - begin, min(stop, begin + self._window) - begin
            out.append([part[lo:hi] for part in self._blocks[k].result()])
        return out

    def close(self) -> None:
        """Cancel gathers not started, wait for the one running, end the thread; idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._blocks.clear()


def joined(pieces: list[Block]) -> list[Any]:
    """One batch from its pieces: tensors concatenated, key lists chained (one piece is returned as is)."""
    if len(pieces) == 1:
        return list(pieces[0])
    return [torch.cat(parts) if isinstance(parts[0], torch.Tensor) else [x for part in parts for x in part]
            for parts in zip(*pieces)]
