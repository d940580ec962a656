"""Batches moved to the training device on a side CUDA stream, so the copy and the uint8 normalisation overlap the
step before them instead of following it.

``to_device`` with ``non_blocking=True`` returns at once, but it queues the copy on the stream the step runs on:
the host runs ahead of the GPU, so batch n+1's copy and normalisation are queued behind step n's kernels and start
only when step n ends. Here they go on a stream of their own and run beside step n; the step's stream waits for
them with an event (no host sync) before step n+1, and ``record_stream`` tells the caching allocator the tensors are
used on the step's stream, so their memory is not reused under it. Off CUDA the same function runs in line.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class SideStreamCopy:
    """Where ``to_device`` runs: ``with copy.copying():`` puts its work on the side stream (CUDA) and
    ``copy.hand_over(*tensors)`` makes the step's stream wait for it; on other devices both do nothing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ready: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        if self.side is None:
            yield
            return
        with torch.cuda.stream(self.side):
            yield
        self._ready = self.side.record_event()

    def hand_over(self, *tensors: torch.Tensor) -> None:
        if self.side is None or self._ready is None:
            return
        step_stream = torch.cuda.current_stream(self.device)
        step_stream.wait_event(self._ready)
        for tensor in tensors:
            tensor.record_stream(step_stream)
        self._ready = None
