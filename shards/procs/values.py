"""A block of numbers shared by a process and its DataLoader workers (epoch and resume state, stage seconds, cache
counters), and how it pickles.

A DataLoader hands its dataset to each worker: inherited under ``fork``, pickled while the worker starts under
``spawn`` and ``forkserver``. A ``multiprocessing.Array`` may only be pickled then (the worker gets the same shared
memory); pickled at any other time (a deep copy, a checkpoint) it would raise, so such a copy carries the values
instead and gets a block of its own. Subclasses keep their block in ``self._array`` and pickle through this class.
"""

from __future__ import annotations

from multiprocessing import context as mp_context
from multiprocessing.context import BaseContext

from shards.jobs.parallel import start_context

MAX_WORKERS = 256  # DataLoader workers per loader that shared blocks (and saved states) have room for


class SharedValues:
    """Owner of ``self._array``: ``length`` numbers of ``typecode`` in shared memory, with a lock unless ``lock`` is
    False (one writer per slot needs none), made by ``context`` (default: ``start_context()``, the workers' own)."""

    def __init__(self, typecode: str, length: int, *, lock: bool = True, context: BaseContext | None = None):
        self._typecode, self._locked = typecode, lock
        self._array = (context or start_context()).Array(typecode, length, lock=lock)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if mp_context.get_spawning_popen() is None:
            # Pickled outside process start-up (a copy, a checkpoint): carry the values, not the shared block.
            state["_array"] = list(self._array[:])
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if isinstance(self._array, list):
            values = self._array
            self._array = start_context().Array(self._typecode, len(values), lock=self._locked)
            self._array[:] = values
