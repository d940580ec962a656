"""What each DataLoader worker is decoding right now, in shared memory, so the main process can name the sample a
hung or dead worker was on (``shards.loader.watchdog``) without asking the worker.

A worker can no longer answer once it hangs or dies, so it publishes before each decode: the sample's global row,
its key and since when (``time.monotonic_ns``), and marks itself idle once the sample came out. One writer per
row needs no lock; the cost is a clock read, three stores and a short byte copy per sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shards.procs.values import MAX_WORKERS
from shards.procs.values import SharedValues

KEY_BYTES = 240  # a key longer than this is published cut short (the row names the sample exactly)
_ROW, _SINCE, _KEY_LENGTH = range(3)
_WIDTH = 3
IDLE = 0


@dataclass(frozen=True)
class Busy:
    """A worker's sample: global row of the split, key, and since when (``time.monotonic_ns``)."""

    row: int
    key: str
    since_ns: int

    def seconds(self) -> float:
        return (time.monotonic_ns() - self.since_ns) / 1e9


class WorkerStatus:
    """Per DataLoader worker (by its id): the sample it is decoding, or idle."""

    def __init__(self) -> None:
        self._numbers = SharedValues("q", MAX_WORKERS * _WIDTH, lock=False)
        self._keys = SharedValues("B", MAX_WORKERS * KEY_BYTES, lock=False)

    def slot(self, worker: int) -> WorkerSlot:
        return WorkerSlot(self._numbers._array, self._keys._array, worker % MAX_WORKERS)

    def busy(self, worker: int) -> Busy | None:
        """What ``worker`` is decoding, or None when it is idle (between samples, reading, waiting for work)."""
        numbers, base = self._numbers._array, (worker % MAX_WORKERS) * _WIDTH
        since = int(numbers[base + _SINCE])
        if since == IDLE:
            return None
        start = (worker % MAX_WORKERS) * KEY_BYTES
        length = int(numbers[base + _KEY_LENGTH])
        key = bytes(self._keys._array[start:start + length]).decode("utf-8", "replace")
        return Busy(int(numbers[base + _ROW]), key, since)

    def clear(self) -> None:
        """Every worker idle: before fresh workers start (a killed one never cleared its row)."""
        self._numbers._array[:] = [0] * (MAX_WORKERS * _WIDTH)


class WorkerSlot:
    """One worker's row, as the worker writes it."""

    __slots__ = ("numbers", "keys", "base", "key_base")

    def __init__(self, numbers, keys, worker: int):
        self.numbers, self.keys = numbers, keys
        self.base, self.key_base = worker * _WIDTH, worker * KEY_BYTES

    def working(self, row: int, key: str) -> None:
        numbers, base = self.numbers, self.base
        numbers[base + _SINCE] = IDLE  # while the row and key change, the main process reads "idle"
        encoded = key.encode("utf-8")[:KEY_BYTES]
        self.keys[self.key_base:self.key_base + len(encoded)] = encoded
        numbers[base + _KEY_LENGTH] = len(encoded)
        numbers[base + _ROW] = row
        numbers[base + _SINCE] = time.monotonic_ns()

    def idle(self) -> None:
        self.numbers[self.base + _SINCE] = IDLE
