"""The ``skip`` error policy's bookkeeping, per worker stream: what a bad sample costs and when to give up.

``skip`` keeps the epoch length: a bad sample's slot is filled by a good one, so DDP ranks stay in step. The
stand-ins are spread: a run of skipped slots takes the good samples just before it, most recent first (up to
``STAND_INS`` different ones), and slots skipped before any good sample take the good samples that follow, one
each. Every skip is logged once, naming shard and key, and counted in the shared epoch state; a run of bad samples
stops the epoch (a shard that is wholly unreadable is a problem to report, not to paper over).

A quarantined sample (``shards.loader.watchdog``: a worker hung or died on it twice) gets a stand-in the same way,
whatever the error policy: it is not a data error the policy decides on, but a sample already judged and recorded.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator

from shards.errors import CorruptDataError

log = logging.getLogger("shards.stream.dataset")

STAND_INS = 8  # recent good outputs kept per worker stream: enough to spread a run of skips, few to hold in memory


def reason_of(exc: CorruptDataError, where: str) -> str:
    """An error's message without the shard and key a log line or ``Broken`` marker already names (the file it
    names is kept when it is another: an index sidecar, a node-local copy)."""
    return exc.reason if exc.path in (None, where) else f"{exc.path}: {exc.reason}"


@dataclass
class ErrorTally:
    """One worker stream's tally under ``config``'s error policy; ``state`` is the shared epoch state (the
    skipped count every process adds to); ``keeps_recent``: keep stand-ins under any policy (quarantined rows)."""

    config: Any
    state: Any
    keeps_recent: bool = False
    consecutive: int = 0
    pending: int = 0  # skipped slots not yet filled: those before the stream's first good sample
    recent: deque = field(default_factory=lambda: deque(maxlen=STAND_INS))
    stood_in: int = 0  # quarantined slots filled so far: spreads their stand-ins like a run of skips

    def __post_init__(self) -> None:
        self.keeps_recent = self.keeps_recent or self.config.on_error == "skip"

    def skipped(self, where: str, key: str | None, reason: str) -> Iterator[Any]:
        """Count and log one bad sample (``reason`` without shard and key), then fill its slot if a good sample
        came before it. Raises with ``on_error="raise"`` and after ``max_consecutive_errors`` bad ones in a row."""
        if self.config.on_error == "raise":
            raise CorruptDataError(reason, path=where, key=key)
        self.consecutive += 1
        self.state.add_skipped()
        log.warning("skipping unreadable sample: %s: %s", where if key is None else f"{where} [sample {key}]",
                    reason)
        if self.consecutive >= self.config.max_consecutive_errors:
            raise CorruptDataError(
                f"{self.consecutive} consecutive unreadable samples (max_consecutive_errors="
                f"{self.config.max_consecutive_errors}); last: {reason}", path=where, key=key)
        yield from self._fill(self.consecutive - 1)

    def stand_in(self) -> Iterator[Any]:
        """Fill a quarantined sample's slot (no error, no count: the quarantine is recorded where it was made)."""
        self.stood_in += 1
        yield from self._fill(self.stood_in - 1)

    def _fill(self, turn: int) -> Iterator[Any]:
        """A slot's stand-in: the ``turn``-th most recent good sample, or later the next good one."""
        if self.recent:
            yield self.recent[-1 - turn % len(self.recent)]
        else:
            self.pending += 1

    def emit(self, output: Any) -> Iterator[Any]:
        """A good sample, and once more for the oldest slot still unfilled."""
        self.consecutive = 0
        if self.keeps_recent:
            self.recent.append(output)
        yield output
        if self.pending:
            self.pending -= 1
            yield output

    def finish(self, where: str) -> Iterator[Any]:
        """At the end of the stream: the slots still unfilled, from the last good samples."""
        if self.pending and not self.recent:
            raise CorruptDataError(f"no readable sample left to stand in for {self.pending} unreadable one(s)",
                                   path=where)
        for turn in range(self.pending):
            yield self.recent[-1 - turn % len(self.recent)]
        self.pending = 0
