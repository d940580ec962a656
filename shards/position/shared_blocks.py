"""How the main process tells DataLoader workers where an epoch stands: blocks of shared integers.

A DataLoader copies the dataset into each worker (fork or spawn) and keeps the copies alive with
``persistent_workers``; an epoch stored as a plain attribute would be lost there (webdataset #172). So the epoch
(``SharedEpochState``, the dataset's: ``set_epoch``, and the skipped count workers write back), the resume of
one iteration (``SharedResume``, carrying a ``Resume``) and the quarantined rows (``SharedQuarantine``), both the
loader's cursor's, are blocks of shared integers that every worker reads when it starts an epoch. What a saved
state holds and how a batch count becomes a ``Resume`` is ``shards.position.resume``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from shards.errors import InputError
from shards.procs.values import MAX_WORKERS, SharedValues

MAX_QUARANTINED = 10_000  # a state carries them all; more means a broken node or dataset, not a few bad samples
_EPOCH, _SKIPPED = range(2)
_RESUME_EPOCH, _RESUME_WORKERS, _ROTATION, _REMAINDER, _SKIPS = range(5)
NO_RESUME = -1


@dataclass(frozen=True)
class Resume:
    """Where an interrupted epoch stopped: per logical worker, how many samples were consumed, and which worker's
    batch came next (DataLoader starts its round robin at worker 0, so a resumed run rotates the workers).
    ``remainder``: the epoch continues in another layout, over the rows its continuation has left."""

    epoch: int
    skips: tuple[int, ...]
    rotation: int = 0
    remainder: bool = False


class SharedEpochState(SharedValues):
    """The dataset's numbers its worker copies share: the epoch to stream (``set_epoch``) and the samples skipped."""

    def __init__(self, epoch: int = 0):
        super().__init__("q", 2)
        self._array[_EPOCH] = epoch

    @property
    def epoch(self) -> int:
        return int(self._array[_EPOCH])

    @epoch.setter
    def epoch(self, value: int) -> None:
        if value < 0:
            raise InputError(f"epoch must be non-negative, got {value}")
        self._array[_EPOCH] = int(value)

    def add_skipped(self, count: int = 1) -> None:
        with self._array.get_lock():
            self._array[_SKIPPED] += count

    @property
    def skipped(self) -> int:
        return int(self._array[_SKIPPED])


class SharedResume(SharedValues):
    """The resume a loader's main process hands to its workers for one iteration (persistent ones included)."""

    def __init__(self) -> None:
        super().__init__("q", _SKIPS + MAX_WORKERS)
        self._array[_RESUME_EPOCH] = NO_RESUME

    def write(self, resume: Resume | None) -> None:
        with self._array.get_lock():
            if resume is None:
                self._array[_RESUME_EPOCH] = NO_RESUME
                return
            if len(resume.skips) > MAX_WORKERS:
                raise InputError(f"at most {MAX_WORKERS} DataLoader workers can be resumed")
            self._array[_RESUME_WORKERS] = len(resume.skips)
            self._array[_ROTATION] = resume.rotation
            self._array[_REMAINDER] = int(resume.remainder)
            for worker, skip in enumerate(resume.skips):
                self._array[_SKIPS + worker] = skip
            self._array[_RESUME_EPOCH] = resume.epoch

    def read(self, epoch: int, num_workers: int) -> Resume | None:
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
            return Resume(epoch, skips, int(self._array[_ROTATION]), bool(self._array[_REMAINDER]))


class SharedQuarantine(SharedValues):
    """The quarantined rows a loader's workers leave out (``shards.loader.watchdog``), written by the main process's
    cursor, read by each worker when it starts an epoch: a running persistent worker sees a quarantine that a
    loaded state or a restart added, as it sees the epoch. Keys stay in the main process (only it records them)."""

    def __init__(self) -> None:
        super().__init__("q", 1 + MAX_QUARANTINED)

    def write(self, rows: list[int]) -> None:
        check_quarantine_size(len(rows))
        with self._array.get_lock():
            self._array[1:1 + len(rows)] = rows
            self._array[0] = len(rows)

    def rows(self) -> frozenset[int]:
        with self._array.get_lock():
            return frozenset(self._array[1:1 + int(self._array[0])])


def check_quarantine_size(count: int) -> None:
    if count > MAX_QUARANTINED:
        raise InputError(f"{count} quarantined samples exceed the limit of {MAX_QUARANTINED}: workers hang or die "
                         "on this data far too often to paper over; find the cause (the stack dumps name it)")
