"""Distributed set-up: one process, or one process per device under ``torchrun``.

torchrun (and Slurm through it) describes the job with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``; that
is the process-group contract rather than configuration, so it is read here. gloo on CPU, NCCL on CUDA. Only rank 0
logs and writes files; the others compute and join the collectives.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from shards.jobs.devices import resolve_device

log = logging.getLogger("shardcache.train")


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool  # we initialised the process group, so we tear it down
    local_world_size: int = 1  # processes on this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def nodes(self) -> int:
        """Nodes of the job, as torchrun numbers ranks (each node's ranks contiguous); 1 when it cannot tell."""
        local = max(1, self.local_world_size)
        return self.world_size // local if self.world_size % local == 0 else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def close(self) -> None:
        """Free what still holds the group (a DDP model in a reference cycle, its finished work objects) and destroy
        the group while the interpreter is whole: gloo work that outlives it is freed during interpreter
        finalization, takes the GIL there and aborts the process after a run that succeeded (pytorch#179291)."""
        if self.owns_group and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
            gc.collect()


def setup_distributed(requested_device: str, env: Mapping[str, str] | None = None) -> DistContext:
    """Join the job's process group (or use the one the caller made); a single process needs none."""
    env = os.environ if env is None else env
    local_rank = int(env.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        device = resolve_device(requested_device, local_rank)
        return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device, owns_group=False,
                           local_world_size=int(env.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
    world_size = int(env.get("WORLD_SIZE", "1"))
    device = resolve_device(requested_device, local_rank)
    if world_size <= 1:
        return DistContext(0, 1, 0, device, owns_group=False)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, init_method="env://")
    log.info("rank %d of %d on %s (%s)", dist.get_rank(), world_size, device, backend)
    return DistContext(dist.get_rank(), world_size, local_rank, device, owns_group=True,
                       local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)))


def wrap_model(model: nn.Module, ctx: DistContext) -> nn.Module:
    """DistributedDataParallel when there are several processes; the plain model otherwise."""
    if not ctx.distributed:
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def broadcast_flag(value: bool, ctx: DistContext) -> bool:
    """Rank 0's decision, shared, so every rank takes the same branch (e.g. whether a checkpoint exists)."""
    if not ctx.distributed:
        return value
    flag = torch.tensor([1 if value else 0], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.to(ctx.device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())
