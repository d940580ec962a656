"""Epoch and resume state shared with DataLoader workers through shared memory.

A DataLoader copies the dataset into each worker (fork or spawn) and keeps the copies alive with
``persistent_workers``; an epoch stored as a plain attribute would be lost there (webdataset #172). This block of
shared integers is what the main process writes (``set_epoch``, a resume to apply) and every worker reads when it
starts an epoch; workers write back only the count of skipped samples.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from multiprocessing import context as mp_context

from shards.errors import InputError

MAX_WORKERS = 256
_EPOCH, _RESUME_EPOCH, _RESUME_WORKERS, _ROTATION, _SKIPPED, _SKIPS = range(6)
NO_RESUME = -1


@dataclass(frozen=True)
class Resume:
    """Where an interrupted epoch stopped: per logical worker, how many samples were consumed, and which worker's
    batch came next (DataLoader starts its round robin at worker 0, so a resumed run rotates the workers)."""

    epoch: int
    skips: tuple[int, ...]
    rotation: int = 0


class SharedEpochState:
    def __init__(self, epoch: int = 0):
        self._array = multiprocessing.Array("q", _SKIPS + MAX_WORKERS)
        self._array[_EPOCH] = epoch
        self._array[_RESUME_EPOCH] = NO_RESUME

    @property
    def epoch(self) -> int:
        return int(self._array[_EPOCH])

    @epoch.setter
    def epoch(self, value: int) -> None:
        if value < 0:
            raise InputError(f"epoch must be non-negative, got {value}")
        self._array[_EPOCH] = int(value)

    def write_resume(self, resume: Resume | None) -> None:
        with self._array.get_lock():
            if resume is None:
                self._array[_RESUME_EPOCH] = NO_RESUME
                return
            if len(resume.skips) > MAX_WORKERS:
                raise InputError(f"at most {MAX_WORKERS} DataLoader workers can be resumed")
            self._array[_RESUME_WORKERS] = len(resume.skips)
            self._array[_ROTATION] = resume.rotation
            for worker, skip in enumerate(resume.skips):
                self._array[_SKIPS + worker] = skip
            self._array[_RESUME_EPOCH] = resume.epoch

    def read_resume(self, epoch: int, num_workers: int) -> Resume | None:
        with self._array.get_lock():
            if self._array[_RESUME_EPOCH] != epoch:
                return None
            workers = int(self._array[_RESUME_WORKERS])
            if workers != num_workers:
                raise InputError(
                    f"the saved state was taken with {workers} DataLoader worker(s) but this run has {num_workers}; "
                    "resume with the same number of workers"
                )
            skips = tuple(int(self._array[_SKIPS + w]) for w in range(workers))
            return Resume(epoch, skips, int(self._array[_ROTATION]))

    def add_skipped(self, count: int = 1) -> None:
        with self._array.get_lock():
            self._array[_SKIPPED] += count

    @property
    def skipped(self) -> int:
        return int(self._array[_SKIPPED])

    def __getstate__(self) -> dict:
        if mp_context.get_spawning_popen() is not None:
            return {"array": self._array}
        # Pickled outside process start-up (a copy, a checkpoint): carry the values, not the shared block.
        values = list(self._array[:])
        return {"values": values}

    def __setstate__(self, state: dict) -> None:
        if "array" in state:
            self._array = state["array"]
            return
        self._array = multiprocessing.Array("q", _SKIPS + MAX_WORKERS)
        self._array[:] = state["values"]
