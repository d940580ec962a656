"""Stopping a run on a signal at a step every rank agrees on, and the line that says where ``--resume`` starts.

The signal handlers are the CLI's (``shards.jobs.preemption.stop_signals``); the run only reads the request. One
process stops after the step in flight. Under torchrun a signal may reach one rank, or each at a different step,
yet every rank must stop after the same step (rank 0 saves the one loader position they all resume from): each
step, each rank sends its flag in an all-reduce on a gloo group of its own, started after that step and read after
the next, so the step waits for no collective and the ranks stop together one step after the signal. At an epoch's
end (validation done, the epoch's ``last.pt`` written) the ranks agree once more, blocking.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shards.jobs.preemption import Preempted, StopRequest
from train.distributed import DistContext


class StopVote:
    """Every rank's answer to "has any rank been asked to stop?", the same at the same step on every rank. Once
    yes, it stays yes (and no further collectives run)."""

    def __init__(self, request: StopRequest | None, ctx: DistContext):
        self.request, self.ctx = request, ctx
        self.decided = False
        # A gloo group for the flag even when training on NCCL: a CPU tensor, so reading it never syncs the GPU.
        self.group = dist.new_group(backend="gloo") if ctx.distributed and request is not None else None
        self.pending: tuple[Any, torch.Tensor] | None = None

    def _flag(self) -> torch.Tensor:
        return torch.tensor([1 if self.request else 0], dtype=torch.int32)

    def _settle(self) -> None:
        if self.pending is not None:
            work, flag = self.pending
            work.wait()
            self.pending = None
            self.decided = self.decided or bool(flag.item())

    def poll(self) -> bool:
        """After a step: True to stop now. One process: the request itself; several: the flags sent one step ago."""
        return self._decide(wait=False)

    def agree(self) -> bool:
        """Between epochs: the flags now, every rank waiting for the others."""
        return self._decide(wait=True)

    def _decide(self, wait: bool) -> bool:
        if self.decided or self.request is None:
            return self.decided
        if self.group is None:
            self.decided = bool(self.request)
            return self.decided
        self._settle()
        if not self.decided:
            flag = self._flag()
            if wait:
                dist.all_reduce(flag, group=self.group)
                self.decided = bool(flag.item())
            else:  # sent now, read after the next step: no rank waits for another mid-epoch
                self.pending = (dist.all_reduce(flag, group=self.group, async_op=True), flag)
        return self.decided

    def close(self) -> None:
        """Wait for the flag in flight (gloo work must not outlive the group: ``DistContext.close``)."""
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None

    def signal_name(self) -> str:
        """The signal this rank got, or, when another rank got it, that it stopped with them."""
        return self.request.signal_name if self.request else "another rank's signal"


def preempted(vote: StopVote, state: Any, batches: int, world_size: int, last_pt: str, is_main: bool) -> Preempted:
    """The exception to raise once the position is saved: rank 0's says where ``--resume`` starts (``state``, the
    loop's ``TrainState`` as saved; ``batches``, the epoch's train batches per rank)."""
    if not is_main:
        return Preempted("", vote.signal_name())
    if state.batch_in_epoch:
        where = (f"epoch {state.epoch + 1}, batch {state.batch_in_epoch + 1} of {batches} (step {state.step + 1}; "
                 f"{state.samples * world_size} samples of the epoch done)")
    else:
        where = f"the start of epoch {state.epoch + 1} (step {state.step + 1})"
    return Preempted(f"stopped by {vote.signal_name()}: saved {last_pt}; --resume starts at {where}",
                     vote.signal_name())
