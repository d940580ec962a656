"""Which torch device a job runs on: one answer for ``precompute-features`` and ``train-from-shards``.

Accepts ``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` and ``cuda:N``. Under torchrun each process
passes its ``local_rank``, and ``auto``/``cuda`` then pick that process's GPU (modulo the GPUs visible), so N
processes on one node use N devices. An unavailable or malformed device is an ``InputError``, never a silent
fallback to the CPU.
"""

from __future__ import annotations

import torch

from shards.errors import InputError


def resolve_device(requested: str, local_rank: int | None = None) -> torch.device:
    """The device ``requested`` names; ``local_rank`` chooses among the GPUs when no index is given."""
    if requested == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        requested = "cuda"
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"device {requested!r} is not a device name ({exc}); use auto, cpu, cuda or cuda:N") \
            from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {requested!r}: CUDA is not available on this machine; use --device auto or cpu")
    if device.type == "cuda" and device.index is None and local_rank is not None:
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return device
