"""Gather the next feature batches in a background thread while the model trains on the current one.

The in-process feature loader has no workers (they only slow features down), so without this every batch's row
gather would sit on the training loop's critical path. torch's indexing releases the GIL, so one thread overlaps it
with the step. Only for loaders that draw no random numbers while producing batches (features): image transforms
in the main process use the global RNG, which a thread would make nondeterministic.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

import torch

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class ThreadPrefetcher:
    """Iterate ``loader`` in a daemon thread, ``depth`` batches ahead; errors surface in the consumer."""

    def __init__(self, loader: Any, *, depth: int = 2, pin_memory: bool = False):
        self.loader = loader
        self.depth = depth
        self.pin_memory = pin_memory

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        slots: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()

        def offer(item: Any) -> bool:
            while not stop.is_set():
                try:
                    slots.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for batch in self.loader:
                    if self.pin_memory:
                        batch = tuple(t.pin_memory() if isinstance(t, torch.Tensor) else t for t in batch)
                    if not offer(batch):
                        return
                offer(_END)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                offer(_Failure(exc))

        thread = threading.Thread(target=produce, name="feature-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = slots.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                yield item
        finally:
            stop.set()
            thread.join(timeout=10)
