"""The data-wait meter: how much of an epoch the training loop spent blocked waiting for the next batch, and where
the time went, stage by stage.

This is the built-in answer to "is my data pipeline the bottleneck?": the share of wall time spent inside
``next(iterator)``, and the seconds per stage (``shards.procs.stage_times``: read, decode, transform, collate in
the workers; wait, to_device, normalize, step in the loop, wall seconds of this process, laps of one clock).
Whether those numbers make a bottleneck, and what to change, is ``train.run.diagnose``'s rule; the epoch row records
its finding and the run report shows it.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from shards.procs.stage_times import LOOP_STAGES, STAGES, stage_delta, zero_stages

T = TypeVar("T")


class DataWaitMeter:
    """Wraps the batch iterator; counts seconds blocked in ``next`` against wall seconds since ``start``.

    ``lap(stage)`` charges the time since the batch arrived (or since the last lap) to a loop stage, so one clock
    read per stage splits the loop. ``worker_stages`` is the loader's cumulative ``stage_seconds``; the meter keeps
    the difference between ``start`` and ``stop``, this epoch's worker seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 worker_stages: Callable[[], dict[str, float]] | None = None) -> None:
        self.clock = clock  # injectable, so tests measure exact shares instead of sleeping
        self.worker_stages = worker_stages
        self.wait_s = 0.0
        self.samples = 0
        self.batches = 0
        self.loop_s = zero_stages(LOOP_STAGES[1:])
        self._started = clock()
        self._stopped: float | None = None
        self._mark = self._started
        self._workers_before = self._workers_now()
        self._workers_epoch: dict[str, float] | None = None

    def _workers_now(self) -> dict[str, float]:
        return self.worker_stages() if self.worker_stages is not None else zero_stages()

    def start(self) -> None:
        self.wait_s, self.samples, self.batches = 0.0, 0, 0
        self.loop_s = zero_stages(LOOP_STAGES[1:])
        self._started, self._stopped = self.clock(), None
        self._mark = self._started
        self._workers_before, self._workers_epoch = self._workers_now(), None

    def stop(self) -> None:
        self._stopped = self.clock()
        self._workers_epoch = stage_delta(self._workers_now(), self._workers_before)

    def iterate(self, batches: Iterable[T]) -> Iterator[T]:
        iterator = iter(batches)
        while True:
            began = self.clock()
            try:
                batch = next(iterator)
            except StopIteration:
                self.wait_s += self.clock() - began
                return
            self._mark = self.clock()
            self.wait_s += self._mark - began
            self.batches += 1
            yield batch

    def lap(self, stage: str) -> None:
        """Charge the seconds since the last lap (or since the batch arrived) to ``stage``."""
        now = self.clock()
        self.loop_s[stage] += now - self._mark
        self._mark = now

    @property
    def worker_seconds(self) -> dict[str, float]:
        """This epoch's worker-stage seconds: final after ``stop``, so far before it."""
        if self._workers_epoch is not None:
            return dict(self._workers_epoch)
        return stage_delta(self._workers_now(), self._workers_before)

    @property
    def stage_seconds(self) -> dict[str, float]:
        """This rank's seconds per stage this epoch, every name of ``STAGES``."""
        return {**self.worker_seconds, "wait": self.wait_s, **self.loop_s}

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


def gather_stage_seconds(seconds: dict[str, float], device: torch.device | str = "cpu") -> list[dict[str, float]]:
    """Every rank's stage seconds, in rank order (one tensor all_gather; ``device`` as in ``reduced``)."""
    values = torch.tensor([float(seconds.get(name, 0.0)) for name in STAGES], dtype=torch.float64, device=device)
    if not (dist.is_available() and dist.is_initialized()):
        return [dict(zip(STAGES, values.tolist()))]
    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, values)
    return [dict(zip(STAGES, rank.tolist())) for rank in gathered]


def sum_stage_seconds(by_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    return {name: sum(rank.get(name, 0.0) for rank in by_rank) for name in STAGES}
