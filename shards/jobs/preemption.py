"""Stop signals: a scheduler's or a user's request to stop becomes a saved position and a distinct exit code.

SIGTERM (Slurm's preemption and time limit, Kubernetes deleting a pod), SIGINT (Ctrl-C) and SIGUSR1 (Slurm's
``--signal=USR1@T``) only set a flag here; the job checks it between steps, finishes the step in flight, saves where
it is and raises ``Preempted``. The CLI prints its one line and exits ``EXIT_PREEMPTED`` (75, ``EX_TEMPFAIL``: try
again later), which a ``--requeue`` script tells apart from success (0), a failure (1), bad input (2) and a second
Ctrl-C (130) (docs/clusters.md, "Preemption").

The handlers are installed only by a command's entry (``stop_signals``, a context manager that restores the
previous handlers on the way out), never by a dataset or a loader. A DataLoader worker forked while they are
installed inherits them: there they do nothing, so a signal sent to every process of the job (Slurm signals the
whole step) does not kill a worker before the main process has saved; the main process stops its workers as it
always does. (torch sets its own SIGTERM handler in each worker, which dies of a SIGTERM not sent by its parent;
``shards.loader.worker_processes.OrphanGuard`` takes SIGTERM back in every worker.) A second SIGINT while stopping raises ``KeyboardInterrupt`` (the impatient Ctrl-C Ctrl-C); the
checkpoint being written then is left as it was, since every checkpoint write is atomic.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager
from typing import Iterator

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
log = logging.getLogger("shardcache")


class StopRequest:
    """Whether a stop signal arrived, and which (the first); false until one does."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def __bool__(self) -> bool:
        return self.signal_name is not None

    def request(self, signum: int) -> None:
        """Record ``signum`` (the first one counts); what the handler does, and what a test or a caller may do."""
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name


class Preempted(Exception):
    """The job stopped on a signal after saving its position; ``line`` says where a rerun starts ("" on a rank
    that leaves the saying to rank 0)."""

    def __init__(self, line: str, signal_name: str):
        super().__init__(line or f"stopped by {signal_name}")
        self.line, self.signal_name = line, signal_name


@contextmanager
def stop_signals(what: str = "the job") -> Iterator[StopRequest]:
    """Catch ``STOP_SIGNALS`` for the duration (``what`` names the job in the line logged when one arrives). Off
    the main thread, where Python cannot install handlers, the request simply never becomes true."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    owner = os.getpid()

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != owner:  # a forked worker: the main process decides, and stops it
            return
        if request and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not request:
            log.warning("%s: finishing the step in flight, then saving the position (%s)", signal.Signals(signum).name,
                        what)
        request.request(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            if signal.getsignal(sig) is handler:  # one set inside the block (a settled exit code's) stays
                signal.signal(sig, old)
