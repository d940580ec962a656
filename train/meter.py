"""The data-wait meter: how much of an epoch the training loop spent blocked waiting for the next batch.

This is the built-in answer to "is my data pipeline the bottleneck?": the share of wall time spent inside
``next(iterator)``. Above 20% the GPU (or CPU) is starving and the advice says what usually fixes it.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
WAIT_WARNING_SHARE = 0.20


class DataWaitMeter:
    """Wraps the batch iterator; counts seconds blocked in ``next`` against wall seconds since ``start``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # injectable, so tests measure exact shares instead of sleeping
        self.wait_s = 0.0
        self.samples = 0
        self.batches = 0
        self._started = clock()
        self._stopped: float | None = None

    def start(self) -> None:
        self.wait_s, self.samples, self.batches = 0.0, 0, 0
        self._started, self._stopped = self.clock(), None

    def stop(self) -> None:
        self._stopped = self.clock()

    def iterate(self, batches: Iterable[T]) -> Iterator[T]:
        iterator = iter(batches)
        while True:
            began = self.clock()
            try:
                batch = next(iterator)
            except StopIteration:
                self.wait_s += self.clock() - began
                return
            self.wait_s += self.clock() - began
            self.batches += 1
            yield batch

    def add_samples(self, count: int) -> None:
        self.samples += count

    @property
    def wall_s(self) -> float:
        end = self._stopped if self._stopped is not None else self.clock()
        return max(end - self._started, 1e-9)

    @property
    def wait_share(self) -> float:
        return min(1.0, self.wait_s / self.wall_s)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s

    def reduced(self, device: torch.device | str = "cpu") -> tuple[float, float]:
        """(global samples/s, mean data-wait share) over all ranks; the slowest rank sets the epoch time.

        ``device`` is where the collective runs: NCCL reduces CUDA tensors only."""
        values = torch.tensor([float(self.samples), self.wall_s, self.wait_share], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            samples = values[:1].clone()
            wall = values[1:2].clone()
            share = values[2:].clone()
            dist.all_reduce(samples)
            dist.all_reduce(wall, op=dist.ReduceOp.MAX)
            dist.all_reduce(share)
            return float(samples) / float(wall), float(share) / world
        return self.samples_per_s, self.wait_share


def wait_advice(share: float, *, data_kind: str, workers: int) -> str | None:
    """What to change when the loop starves; ``None`` when the data pipeline keeps up."""
    if share <= WAIT_WARNING_SHARE:
        return None
    tips = []
    if data_kind == "images":
        tips.append(f"more --workers (now {workers})")
        tips.append("train on precomputed features instead of images (precompute-features, then --data features)")
        tips.append("fast JPEG decode at reduced size, or repack with smaller images")
    tips.append("copy the shards to a local disk (not a network filesystem)")
    if data_kind == "features":
        tips.append("a larger --batch-size (per-batch overhead dominates a small head)")
    return (f"the training loop waited for data {share:.0%} of the epoch (over {WAIT_WARNING_SHARE:.0%}): "
            f"the data pipeline is the bottleneck; try: " + "; ".join(tips))
