"""A stop signal that arrives at a chosen moment, for the preemption tests: deterministic, no timing."""

from __future__ import annotations

import signal

from shards.jobs.preemption import StopRequest


class StopAfter(StopRequest):
    """A SIGTERM that arrives at the run's ``n``-th look at the request (a run looks once per batch or step, and
    once at each epoch's end)."""

    def __init__(self, n: int):
        super().__init__()
        self.left = n

    def __bool__(self) -> bool:
        self.left -= 1
        if self.left <= 0:
            self.request(signal.SIGTERM)
        return super().__bool__()
