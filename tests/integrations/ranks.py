"""Run a function in ``world`` real processes joined by a gloo process group (CPU), as torchrun would start them."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Callable

import torch.multiprocessing as mp

TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, world: int, port: int) -> None:
    """The variables torchrun sets, which Lightning, accelerate and ``init_process_group("env://")`` read."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", GROUP_RANK="0")


def _enter(rank: int, world: int, port: int, target: Callable[..., Any], args: tuple) -> None:
    rank_environment(rank, world, port)
    target(rank, world, *args)


def run_ranks(target: Callable[..., Any], world: int, *args: Any) -> None:
    """``target(rank, world, *args)`` in ``world`` forked processes with torchrun's variables; fails if one fails or
    the group hangs."""
    context = mp.start_processes(_enter, args=(world, free_port(), target, args), nprocs=world, join=False,
                                 start_method="fork")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=TIMEOUT_S)
    while not context.join(timeout=2):
        assert datetime.datetime.now() < deadline, "distributed run hung"
