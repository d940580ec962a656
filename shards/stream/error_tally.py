"""The ``skip`` error policy's bookkeeping, per worker stream: what a bad sample costs and when to give up.

``skip`` keeps the epoch length: a bad sample's slot is filled by repeating a good one, so DDP ranks stay in step;
every skip is logged with shard and key and counted in the shared epoch state, and a run of bad samples stops the
epoch (a shard that is wholly unreadable is a problem to report, not to paper over).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

from shards.errors import CorruptDataError

log = logging.getLogger("shards.stream.dataset")


@dataclass
class ErrorTally:
    """One worker stream's tally under ``config``'s error policy; ``state`` is the shared epoch state (the
    skipped count every process adds to)."""

    config: Any
    state: Any
    consecutive: int = 0
    pending: int = 0
    last_good: Any = field(default=None)

    def failed(self, where: str, key: str | None, reason: str) -> None:
        if self.config.on_error == "raise":
            raise CorruptDataError(reason, path=where, key=key)
        self.consecutive += 1
        self.state.add_skipped()
        log.warning("skipping unreadable sample: %s [sample %s]: %s", where, key, reason)
        if self.consecutive >= self.config.max_consecutive_errors:
            raise CorruptDataError(
                f"{self.consecutive} consecutive unreadable samples (max_consecutive_errors="
                f"{self.config.max_consecutive_errors}); last: {reason}", path=where, key=key)
        self.pending += 1

    def emit(self, output: Any) -> Iterator[Any]:
        self.consecutive = 0
        self.last_good = output
        for _ in range(self.pending + 1):
            yield output
        self.pending = 0

    def fill(self) -> Iterator[Any]:
        if self.last_good is not None:
            self.pending -= 1
            yield self.last_good
