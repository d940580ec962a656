"""The data-wait meter: how much of an epoch the training loop spent blocked waiting for the next batch, and where
the time went, stage by stage.

This is the built-in answer to "is my data pipeline the bottleneck?": the share of wall time spent inside
``next(iterator)``, and the seconds per stage (``shards.procs.stage_times``: read, decode, transform, collate in
the workers; wait, to_device, normalize, step in the loop, wall seconds of this process, laps of one clock).
Whether those numbers make a bottleneck, and what to change, is ``train.run.diagnose``'s rule; the epoch row records
its finding and the run report shows it.

Beside the wait, ``MemoryTrace`` samples the loader's memory in flight over the epoch (``shards.procs.memory``: the
process tree's PSS plus ``/dev/shm``), every ``SAMPLE_EVERY_S`` at the most, as a batch arrives, so the report shows
memory over time next to the data wait of the same intervals (issue 46: a budget that starves the loop shows as
wait, one that does not hold shows as memory). The reads run beside the loop, never in it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch
import torch.distributed as dist

from shards.procs.memory import TreeMemory, tree_memory
from shards.procs.stage_times import LOOP_STAGES, STAGES, stage_delta, zero_stages

T = TypeVar("T")

SAMPLE_EVERY_S = 5.0  # a read walks every process's page tables: tens of ms per large process, off the loop
MAX_SAMPLES = 240  # per epoch: past it every other sample goes and the interval doubles, so a row stays small


class MemoryTrace:
    """The memory of this process tree over an epoch: a sample as the loop starts (the baseline the flight is
    counted from), then as a batch arrives (the first, when the queues are fullest, then at most every
    ``every_s``), and as the epoch ends, each with the seconds the loop had waited for data by then, so every
    interval's wait share is known beside its memory.

    A read walks the page tables of every process in the tree (``shards.procs.memory``), which takes the longer the
    more workers and memory there are, so the loop only stamps the time and the wait and hands the read to a thread
    of its own (one at a time: a batch that finds the last read unfinished is not sampled); ``background=False``
    reads in the loop (tests, with an injected ``read``). Where ``read`` says None nothing is recorded. Each
    sample keeps the tree's whole (``bytes``) and the training process's own part (``main_bytes``): in threads or
    in process the loader's flight is there beside the model's, in worker processes it is the rest."""

    def __init__(self, read: Callable[[], TreeMemory | None] = tree_memory, every_s: float = SAMPLE_EVERY_S,
                 max_samples: int = MAX_SAMPLES, background: bool = True) -> None:
        self.read, self.every_s, self.max_samples = read, every_s, max(2, max_samples)
        self.background = background
        self.t_s: list[float] = []
        self.bytes: list[int] = []
        self.main_bytes: list[int] = []
        self.wait_s: list[float] = []
        self.readable = True
        self._began, self._asked = 0.0, None
        self._lock = threading.Lock()
        self._reading: threading.Thread | None = None

    def begin(self, now: float) -> None:
        """The epoch's loop starts: the baseline is read here, before any worker of the epoch starts."""
        self._join()
        self.t_s, self.bytes, self.main_bytes, self.wait_s, self._began, self._asked = [], [], [], [], now, None
        self._take(0.0, 0.0)

    def due(self, now: float) -> bool:
        """Whether a batch arriving at ``now`` is sampled: the first after the baseline, then every ``every_s``."""
        if not self.readable or not self.t_s or (self._reading is not None and self._reading.is_alive()):
            return False
        return self._asked is None or now - self._began - self._asked >= self.every_s

    def sample(self, now: float, wait_s: float) -> None:
        """A sample stamped ``now`` with the loop's wait so far; read beside the loop unless ``background`` is off."""
        self._asked = now - self._began
        if not self.background:
            self._take(self._asked, wait_s)
            return
        self._reading = threading.Thread(target=self._take, args=(self._asked, wait_s), daemon=True,
                                         name="shardcache-memory-trace")
        self._reading.start()

    def end(self, now: float, wait_s: float) -> None:
        """The epoch's end: the read in flight finished, then what is left as the batches are out."""
        self._join()
        if self.readable and self.t_s:
            self._take(now - self._began, wait_s)

    def _join(self) -> None:
        if self._reading is not None:
            self._reading.join()
            self._reading = None

    def _take(self, t_s: float, wait_s: float) -> None:
        value = self.read() if self.readable else None
        with self._lock:
            if value is None:
                self.readable = False
                return
            self.t_s.append(t_s)
            self.bytes.append(value.total)
            self.main_bytes.append(value.own)
            self.wait_s.append(wait_s)
            if len(self.t_s) > self.max_samples:  # keep the first (the baseline) and every other one after it
                keep = [0, *range(2, len(self.t_s), 2)]
                self.t_s, self.bytes, self.main_bytes, self.wait_s = (
                    [series[i] for i in keep] for series in (self.t_s, self.bytes, self.main_bytes, self.wait_s))
                self.every_s *= 2

    def record(self, budget_bytes: int | None = None) -> dict[str, Any] | None:
        """The trace as ``EpochRow.memory`` holds it; None when nothing could be read. ``wait_share[i]`` is the
        share of the interval up to sample ``i`` the loop waited for data (None for the baseline)."""
        self._join()
        if not self.readable or not self.t_s:
            return None
        start = self.bytes[0]
        shares: list[float | None] = [None]
        for i in range(1, len(self.t_s)):
            span = self.t_s[i] - self.t_s[i - 1]
            shares.append(min(1.0, max(0.0, (self.wait_s[i] - self.wait_s[i - 1]) / span)) if span > 0 else None)
        return {"measure": "pss+shm", "every_s": self.every_s, "start_bytes": start,
                "peak_flight_bytes": max(0, max(self.bytes) - start), "budget_bytes": budget_bytes,
                "t_s": [round(t, 3) for t in self.t_s], "bytes": list(self.bytes), "main_bytes": list(self.main_bytes),
                "wait_share": [None if s is None else round(s, 4) for s in shares]}


class DataWaitMeter:
    """Wraps the batch iterator; counts seconds blocked in ``next`` against wall seconds since ``start``.

    ``lap(stage)`` charges the time since the batch arrived (or since the last lap) to a loop stage, so one clock
    read per stage splits the loop. ``worker_stages`` is the loader's cumulative ``stage_seconds``; the meter keeps
    the difference between ``start`` and ``stop``, this epoch's worker seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter,
                 worker_stages: Callable[[], dict[str, float]] | None = None,
                 memory: MemoryTrace | None = None) -> None:
        self.clock = clock  # injectable, so tests measure exact shares instead of sleeping
        self.worker_stages = worker_stages
        self.memory = memory  # sampled as batches arrive (``MemoryTrace``); None: not sampled
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
        if self.memory is not None:  # the baseline, read before the epoch's clock starts: no part of its time
            self.memory.begin(self.clock())
        self.wait_s, self.samples, self.batches = 0.0, 0, 0
        self.loop_s = zero_stages(LOOP_STAGES[1:])
        self._started, self._stopped = self.clock(), None
        self._mark = self._started
        self._workers_before, self._workers_epoch = self._workers_now(), None

    def stop(self) -> None:
        self._stopped = self.clock()
        if self.memory is not None:
            self.memory.end(self._stopped, self.wait_s)
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
            if self.memory is not None and self.memory.due(self._mark):
                self.memory.sample(self._mark, self.wait_s)
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
