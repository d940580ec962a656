"""``make_loader``: the one ``Loader`` (``shards.loader.base``) around a streaming dataset, with a run mode and
defaults that suit the dataset, and the collate of images of different sizes.

The run mode is one value: ``WorkerProcesses(n)`` (``shards.loader.worker_processes``), ``Threads(n)``
(``shards.loader.threads``), ``InProcess()`` (``shards.loader.in_process``) or ``"auto"``: ``Auto(n)``
(``shards.loader.auto``), the one with the lowest step time; stall recovery is one value too, a ``StallPolicy``
(``shards.loader.watchdog``), which a mode with worker processes or threads applies. A mode has one spelling
(``RunMode.parse``, ``shards.loader.mode_spelling``): the CLI's text, the JSON form configs and run records
keep, a bare count.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from shards.errors import InputError
from shards.loader.auto import Auto
from shards.loader.base import Loader, RunMode
from shards.loader.budget import MemoryBudget, resolve_budget
from shards.loader.in_process import InProcess
from shards.loader.mode_spelling import default_num_workers
from shards.loader.torch_keywords import (
    check_process_options, refuse_unknown, with_queue_options, workers_of,
)
from shards.loader.watchdog import StallPolicy
from shards.loader.worker_processes import WorkerProcesses


def default_mode(dataset: Any) -> RunMode:
    """In process for feature rows (worker processes only slow them down), worker processes for images."""
    return InProcess() if dataset.ready_rows else WorkerProcesses(default_num_workers())


def auto_mode(dataset: Any, workers: int | None = None) -> RunMode:
    """``Auto(workers)`` (default: ``default_num_workers()``, the plan the default mode feeds) over images; over
    feature rows ``InProcess()``, which no other mode comes near (there is nothing to try)."""
    if dataset.ready_rows:
        return InProcess()
    return Auto(default_num_workers() if workers is None else workers)


def workers_mode(workers: int, *, persistent: bool = True, run: str = "processes", decoders: int = 0) -> RunMode:
    """The mode a CLI's ``--workers``, ``--run-mode`` and ``--worker-threads`` name, through the one parse
    (``RunMode.parse``): ``run="processes"``: ``WorkerProcesses(workers, persistent=, decoders=)``, or
    ``InProcess()`` for 0 (the worker options then have no processes to apply to); ``run="threads"``:
    ``Threads(workers, decoders=)``. ``decoders`` <= 1 is 0: a worker decoding its own samples (the CLI's
    ``--worker-threads 1``)."""
    if run not in ("processes", "threads"):
        raise InputError(f"run mode must be 'processes' or 'threads', got {run!r}")
    if run == "threads" and workers == 0:
        raise InputError("the thread run mode needs workers >= 1 (each is a thread)")
    if workers == 0:
        return RunMode.parse(0)
    record: dict[str, Any] = {"kind": run, "workers": workers, "decoders": decoders if decoders > 1 else 0}
    if run == "processes":
        record["persistent"] = persistent
    return RunMode.parse(record)


def make_loader(dataset: Any, batch_size: int = 256, *, mode: RunMode | str | dict | None = None,
                stall: StallPolicy | None = None, drop_last: bool | None = None, collate_fn: Callable | None = None,
                pin_memory: bool | None = None, stage_times: bool = True, resume_audit: str = "refuse",
                num_workers: int | None = None, prefetch_factor: int | None = None,
                persistent_workers: bool | None = None, worker_init_fn: Callable[[int], Any] | None = None,
                multiprocessing_context: Any = None, generator: torch.Generator | None = None, timeout: float = 0,
                memory: int | str | MemoryBudget | None = None, **unknown: Any) -> Loader:
    """Batches from a dataset of ``open_dataset``, with defaults that suit it.

    ``mode`` defaults to ``default_mode``: ``InProcess()`` for a feature dataset, ``WorkerProcesses(n)`` for
    images, with ``n`` the usable CPUs minus one (max 8); ``"auto"`` (``auto_mode``) tries ``Threads(n)``,
    ``WorkerProcesses(n)`` and threads inside processes over the first batches and keeps the lowest step time,
    feeding exactly the batches of the default (``loader.mode_choice()`` says what it tried and chose).
    ``pin_memory`` defaults to whether CUDA is present (a feature table gathered in process: False, the copy would
    be synchronous), ``drop_last`` to ``dataset.config.shuffle`` (training). ``stage_times=False`` turns off the
    per-stage seconds (``stage_seconds()`` then stays at 0), for measuring what they cost.

    DataLoader's keywords mean what they mean there (``shards.loader.torch_keywords``): ``num_workers=n`` is
    ``mode=WorkerProcesses(n)`` (0: ``InProcess()``); ``prefetch_factor`` and ``persistent_workers`` set the
    workers of that mode (or of the default); ``worker_init_fn`` runs in each worker process,
    ``multiprocessing_context`` starts them, ``generator`` is what the DataLoader draws its workers' base seed from
    (default: one seeded with ``dataset.config.seed``; modes without a DataLoader draw nothing). What a mode cannot
    honour is refused in one line with the reason, as are ``shuffle``/``sampler`` (the order is
    ``open_dataset(sampling=Sampling(...))``), ``timeout`` (``stall=``) and unknown keywords (with a did-you-mean).

    ``stall`` (``StallPolicy(timeout_s, max_restarts, stack_dir, on_event)``; None: off): no batch for
    ``timeout_s``, or a worker process gone, restarts the workers at the exact position
    (``shards.loader.watchdog``); a sample a worker hung or died on twice is quarantined (``loader.quarantined``,
    carried in ``state_dict``). A mode without worker processes refuses it with an ``InputError``.

    ``resume_audit`` (``"refuse"``, ``"warn"``, ``"off"``): every ``state_dict`` carries the keys of the last
    batches fed and of the next ones the plan gives; ``load_state_dict`` checks them, and the first batches fed
    after it, against the plan and refuses (or warns about) a state that disagrees (``shards.position.audit``).

    ``memory`` (bytes, ``"512MiB"`` or a ``MemoryBudget``): the bytes this rank's loader holds in flight at most;
    the mode's prefetch depth is fitted to it and a budget below one batch per worker is refused
    (``shards.loader.budget``), and so are decode-ahead and, counted as the dataset's options make them, remote
    read-ahead and feature windows (``split_budget``). Default: a quarter of the memory the job may still fill;
    ranks sharing a node pass ``memory=default_budget(ranks=n)`` (train does, from its local world size).
    """
    if unknown:  # the did-you-mean offers make_loader's own parameters, whatever they are by then
        refuse_unknown(unknown, [name for name in inspect.signature(make_loader).parameters
                                 if name not in ("dataset", "unknown")])
    named = mode is not None and num_workers is None  # the caller chose the mode (and its worker options)
    mode = resolve_mode(dataset, mode, num_workers)
    mode = with_queue_options(mode, dataset, named=named, prefetch_factor=prefetch_factor,
                              persistent_workers=persistent_workers)
    check_process_options(mode, dataset, named=named, worker_init_fn=worker_init_fn,
                          multiprocessing_context=multiprocessing_context, timeout=timeout, collate_fn=collate_fn)
    for name, value in (("drop_last", drop_last), ("pin_memory", pin_memory), ("stage_times", stage_times)):
        if value is not None and not isinstance(value, bool):  # "no" and 0 are not False: never read as truthy
            raise InputError(f"{name}={value!r}: must be True or False")
    if drop_last is None:
        drop_last = dataset.config.shuffle
    if pin_memory is None:
        pin_memory = torch.cuda.is_available() and worth_pinning(dataset, mode)
    if generator is None:
        # DataLoader draws its workers' base seed from this generator at every iter(); left to the global RNG it
        # would shift the training loop's random numbers by one draw per epoch (and differently after a resume).
        generator = torch.Generator().manual_seed(dataset.config.seed)
    return Loader(dataset, batch_size, mode, drop_last=drop_last, stall=stall,
                  stage_times=stage_times, collate_fn=collate_fn, pin_memory=pin_memory, resume_audit=resume_audit,
                  worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context, generator=generator,
                  memory=resolve_budget(memory))


def worth_pinning(dataset: Any, mode: RunMode) -> bool:
    """Whether pinned batches are worth their copy: not for a feature table gathered in the loop's own thread
    (``InProcess``), where the pin is one more synchronous copy before the one to the GPU. The default of
    ``pin_memory``; an explicit ``pin_memory=True`` pins there too."""
    return not (isinstance(mode, InProcess) and mode.gathers(dataset))


def resolve_mode(dataset: Any, mode: Any, num_workers: int | None = None) -> RunMode:
    """The run mode ``make_loader`` runs: ``num_workers``'s (``WorkerProcesses(n)``, 0 ``InProcess()``), the
    dataset kind's default, ``auto_mode`` for ``"auto"``, or the mode ``mode`` spells (``RunMode.parse``: a mode,
    its text or its JSON form; ``"auto"`` over feature rows is ``InProcess()``, as ``auto_mode`` says)."""
    if num_workers is not None:
        return workers_of(num_workers, mode)
    if mode is None:
        return default_mode(dataset)
    if isinstance(mode, int):  # a bare count is an older record's spelling; here it is DataLoader's keyword
        raise InputError(f"mode must be a run mode, not a count: num_workers={mode!r}, or mode='processes:{mode}' "
                         "(RunMode.parse)")
    parsed = RunMode.parse(mode)
    if isinstance(parsed, Auto) and dataset.ready_rows:
        return InProcess()  # nothing to try over feature rows (``auto_mode``)
    return parsed


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
