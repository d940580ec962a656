"""``make_loader``: the one ``Loader`` (``shards.loader.base``) around a streaming dataset, with a run mode and
defaults that suit the dataset, and the collate of images of different sizes.

The run mode is one value: ``WorkerProcesses(n)`` (``shards.loader.worker_processes``), ``Threads(n)``
(``shards.loader.threads``), ``InProcess()`` (``shards.loader.in_process``) or ``"auto"``: ``Auto(n)``
(``shards.loader.auto``), the one with the lowest step time; stall recovery is one value too, a ``StallPolicy``
(``shards.loader.watchdog``), which a mode with worker processes or threads applies.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from shards.jobs.parallel import MAX_DEFAULT_WORKERS, usable_cpus
from shards.errors import InputError
from shards.loader.auto import Auto
from shards.loader.base import Loader, RunMode
from shards.loader.in_process import InProcess
from shards.loader.threads import Threads
from shards.loader.watchdog import StallPolicy
from shards.loader.worker_processes import WorkerProcesses
from shards.stream.feature_stream import FeatureShardDataset


def default_num_workers() -> int:
    """One worker per CPU this process may use, leaving one for the training loop, capped at 8."""
    return max(1, min(MAX_DEFAULT_WORKERS, usable_cpus() - 1))


def default_mode(dataset: Any) -> RunMode:
    """In process for feature rows (worker processes only slow them down), worker processes for images."""
    return InProcess() if isinstance(dataset, FeatureShardDataset) else WorkerProcesses(default_num_workers())


def auto_mode(dataset: Any, workers: int | None = None) -> RunMode:
    """``Auto(workers)`` (default: ``default_num_workers()``, the plan the default mode feeds) over images; over
    feature rows ``InProcess()``, which no other mode comes near (there is nothing to try)."""
    if isinstance(dataset, FeatureShardDataset):
        return InProcess()
    return Auto(default_num_workers() if workers is None else workers)


def workers_mode(workers: int, *, prefetch_factor: int = 4, persistent: bool = True, run: str = "processes",
                 threads: int = 1) -> RunMode:
    """The mode a CLI's ``--workers`` and ``--run-mode`` name: ``run="processes"``: ``WorkerProcesses(workers,
    ..., threads=threads)``, or ``InProcess()`` for 0 (the worker options then have no processes to apply to);
    ``run="threads"``: ``Threads(workers)`` (``threads`` decode threads shared by them, when more than 1)."""
    if run == "threads":
        if workers == 0:
            raise InputError("the thread run mode needs workers >= 1 (each is a thread)")
        return Threads(workers, decoders=threads if threads > 1 else 0)
    if run != "processes":
        raise InputError(f"run mode must be 'processes' or 'threads', got {run!r}")
    if workers == 0:
        return InProcess()
    return WorkerProcesses(workers, prefetch_factor=prefetch_factor, persistent=persistent, threads=threads)


def make_loader(dataset: Any, batch_size: int = 256, *, mode: RunMode | str | None = None,
                stall: StallPolicy | None = None, drop_last: bool | None = None, collate_fn: Callable | None = None,
                pin_memory: bool | None = None, stage_times: bool = True, resume_audit: str = "refuse",
                **dataloader_options: Any) -> Loader:
    """Batches from a dataset of ``open_dataset``, with defaults that suit it.

    ``mode`` defaults to ``default_mode``: ``InProcess()`` for a feature dataset, ``WorkerProcesses(n)`` for
    images, with ``n`` the usable CPUs minus one (max 8); ``"auto"`` (``auto_mode``) tries ``Threads(n)``,
    ``WorkerProcesses(n)`` and threads inside processes over the first batches and keeps the lowest step time,
    feeding exactly the batches of the default (``loader.mode_choice()`` says what it tried and chose). ``pin_memory`` defaults to whether CUDA is present,
    ``drop_last`` to ``dataset.config.shuffle`` (training). ``stage_times=False`` turns off the per-stage seconds
    (``stage_seconds()`` then stays at 0), for measuring what they cost.

    ``stall`` (``StallPolicy(timeout_s, max_restarts, stack_dir, on_event)``; None: off): no batch for
    ``timeout_s``, or a worker process gone, restarts the workers at the exact position
    (``shards.loader.watchdog``); a sample a worker hung or died on twice is quarantined (``loader.quarantined``,
    carried in ``state_dict``). A mode without worker processes refuses it with an ``InputError``.

    ``resume_audit`` (``"refuse"``, ``"warn"``, ``"off"``): every ``state_dict`` carries the keys of the last
    batches fed and of the next ones the plan gives; ``load_state_dict`` checks them, and the first batches fed
    after it, against the plan and refuses (or warns about) a state that disagrees (``shards.position.audit``).
    """
    if mode is None:
        mode = default_mode(dataset)
    elif mode == "auto":
        mode = auto_mode(dataset)
    if drop_last is None:
        drop_last = dataset.config.shuffle
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    # DataLoader draws its workers' base seed from this generator at every iter(); left to the global RNG it
    # would shift the training loop's random numbers by one draw per epoch (and differently after a resume).
    dataloader_options.setdefault("generator", torch.Generator().manual_seed(dataset.config.seed))
    return Loader(dataset, batch_size, mode, drop_last=drop_last, stall=stall, stage_times=stage_times,
                  collate_fn=collate_fn, pin_memory=pin_memory, resume_audit=resume_audit, **dataloader_options)


def pad_collate(batch: Sequence[tuple]) -> dict[str, Any]:
    """Collate images of different sizes: pad to the largest height and width (bottom/right, zeros).

    Returns ``{"images": [B, C, H, W], "labels": [B], "sizes": [B, 2] (h, w), "mask": [B, H, W] bool}`` and
    ``"keys"`` when samples carry them. PIL images become uint8 tensors; tensors keep their dtype.
    """
    from torchvision.transforms.functional import pil_to_tensor

    images = [item[0] if isinstance(item[0], torch.Tensor) else pil_to_tensor(item[0]) for item in batch]
    height = max(image.shape[-2] for image in images)
    width = max(image.shape[-1] for image in images)
    out = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    mask = torch.zeros((len(images), height, width), dtype=torch.bool)
    for i, image in enumerate(images):
        out[i, :, : image.shape[-2], : image.shape[-1]] = image
        mask[i, : image.shape[-2], : image.shape[-1]] = True
    result = {
        "images": out,
        "labels": torch.as_tensor([item[1] for item in batch], dtype=torch.int64),
        "sizes": torch.as_tensor([tuple(image.shape[-2:]) for image in images], dtype=torch.int64),
        "mask": mask,
    }
    if len(batch[0]) > 2:
        result["keys"] = [item[2] for item in batch]
    return result
