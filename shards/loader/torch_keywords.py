"""What ``make_loader`` says to a PyTorch user's DataLoader keywords: each one either does what it does in
``torch.utils.data.DataLoader`` or is refused in one line naming shardcache's spelling, and nothing is passed on
to a place that would ignore it.

Why one module: the keywords a DataLoader habit brings (``num_workers``, ``shuffle``, ``prefetch_factor``, ...)
meet a loader whose order belongs to the dataset (``open_dataset(sampling=Sampling(...))``) and whose workers may be
processes, threads or none (the run mode). A keyword that means nothing in the mode at hand (``worker_init_fn``
where no worker process starts, ``collate_fn`` where a feature table's batches are gathered whole) is refused with
the reason, never dropped. The accepted keywords are ``make_loader``'s own parameters: a new one is one more
parameter there, and the did-you-mean of an unknown keyword lists it with no change here.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable, Iterable

from shards.errors import InputError
from shards.loader.auto import Auto
from shards.loader.base import RunMode
from shards.loader.in_process import InProcess
from shards.loader.threads import Threads
from shards.loader.worker_processes import WorkerProcesses

_ORDER = ("the order is the dataset's, a function of (seed, epoch, rank): open_dataset(..., seed=, "
          "sampling=Sampling(shuffle=True|False, class_weights=, balance=))")

# Keywords of DataLoader (and of older shardcache calls) that are spelled another way here: the spelling.
OUR_SPELLING = {
    "shuffle": _ORDER,
    "sampler": _ORDER + "; a rank's share: distributed=Distributed(rank=, world_size=)",
    "batch_sampler": _ORDER + ", in batches of make_loader(batch_size=)",
    "workers": "the run mode is mode= ('auto', WorkerProcesses(n), Threads(n), InProcess()), or num_workers=n",
    "run_mode": "the run mode is mode= ('auto', WorkerProcesses(n), Threads(n), InProcess())",
    "in_order": "batches always come in the plan's order (exact resume depends on it): leave in_order out",
    "pin_memory_device": "pin_memory=True pins batches for the current CUDA device",
}


def refuse_unknown(given: dict[str, Any], accepted: Iterable[str], where: str = "make_loader") -> None:
    """An ``InputError`` naming the first keyword of ``given`` (all of which ``where`` did not take): its
    spelling here when it is a DataLoader keyword spelled otherwise, else the nearest accepted name."""
    if not given:
        return
    name = sorted(given)[0]
    if name in OUR_SPELLING:
        raise InputError(f"{where}() does not take {name}=: {OUR_SPELLING[name]}")
    accepted = sorted(accepted)
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = f"did you mean {close[0]}=?" if close else f"it takes {', '.join(accepted)}"
    raise InputError(f"{where}() got an unknown keyword {name}=: {hint}")


def workers_of(num_workers: Any, mode: Any) -> RunMode:
    """DataLoader's ``num_workers``: ``WorkerProcesses(n)``, 0 ``InProcess()``; refused beside a ``mode``."""
    if mode is not None:
        raise InputError(f"give num_workers or mode, not both (got num_workers={num_workers!r} and mode={mode!r}): "
                         "num_workers=n is mode=WorkerProcesses(n), num_workers=0 mode=InProcess()")
    if type(num_workers) is not int or num_workers < 0:
        raise InputError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    return InProcess() if num_workers == 0 else WorkerProcesses(num_workers)


def _who(mode: RunMode, dataset: Any, named: bool) -> str:
    """The mode as a refusal names it: a default or ``num_workers`` mode says where it came from."""
    if named:
        return f"mode={mode}"
    feature = " (a feature dataset's default)" if dataset.ready_rows else ""
    return f"{mode}{feature}"


def with_queue_options(mode: RunMode, dataset: Any, *, named: bool, prefetch_factor: Any,
                       persistent_workers: Any) -> RunMode:
    """``mode`` with DataLoader's ``prefetch_factor`` (batches each worker prepares ahead: the mode's ``prefetch``)
    and ``persistent_workers`` (``WorkerProcesses``' ``persistent``). A mode the caller ``named`` carries its own values: giving them beside it is refused, as is a value the mode
    cannot honour (no workers to prepare ahead or to keep)."""
    if prefetch_factor is None and persistent_workers is None:
        return mode
    changes: dict[str, Any] = {}
    if prefetch_factor is not None:
        if not isinstance(mode, (WorkerProcesses, Threads)):
            why = "tries its candidates with their own queues" if isinstance(mode, Auto) else \
                "has no workers that prepare batches ahead"
            raise InputError(f"prefetch_factor={prefetch_factor!r}: {_who(mode, dataset, named)} {why}; use "
                             "num_workers=n (WorkerProcesses(n, prefetch=k)) or Threads(n, prefetch=k)")
        changes["prefetch"] = prefetch_factor
    if persistent_workers is not None:
        if type(persistent_workers) is not bool:
            raise InputError(f"persistent_workers must be True or False, got {persistent_workers!r}")
        if isinstance(mode, WorkerProcesses):
            changes["persistent"] = persistent_workers
        elif persistent_workers or isinstance(mode, Auto):
            why = "tries its candidates with their own settings" if isinstance(mode, Auto) else \
                "keeps no worker processes from epoch to epoch"
            raise InputError(f"persistent_workers={persistent_workers}: {_who(mode, dataset, named)} {why}; use "
                             "num_workers=n (WorkerProcesses(n, persistent=...))")
    if named and changes:
        fields = ", ".join(f"{k}={v!r}" for k, v in changes.items())
        raise InputError(f"mode={mode} carries its own worker options: write them in it "
                         f"({type(mode).__name__}(..., {fields})), not beside it")
    return dataclasses.replace(mode, **changes) if changes else mode


def check_process_options(mode: RunMode, dataset: Any, *, named: bool, worker_init_fn: Callable | None,
                          multiprocessing_context: Any, timeout: Any, collate_fn: Callable | None) -> None:
    """Refuse, with the reason, what ``mode`` would not honour: ``worker_init_fn`` outside worker processes (and
    under ``Auto``, which may choose threads, where it would never run), ``multiprocessing_context`` where no
    process starts, DataLoader's ``timeout`` (``StallPolicy`` is the spelling here), ``collate_fn`` over a feature
    table's whole-batch gathers."""
    who = _who(mode, dataset, named)
    if worker_init_fn is not None and not isinstance(mode, WorkerProcesses):
        why = "may choose threads, where none starts" if isinstance(mode, Auto) else "starts none"
        raise InputError(f"worker_init_fn runs in each DataLoader worker process, and {who} {why}: use "
                         "num_workers=n (WorkerProcesses(n))")
    if multiprocessing_context is not None and not isinstance(mode, (WorkerProcesses, Auto)):
        raise InputError(f"multiprocessing_context={multiprocessing_context!r}: {who} starts no worker processes; use "
                         "num_workers=n (WorkerProcesses(n))")
    method = _start_method(multiprocessing_context)
    if method not in (None, "fork"):
        raise InputError(f"multiprocessing_context={multiprocessing_context!r}: workers here start by fork only (the "
                         f"loader's shared blocks and their locks are made for forked workers; {method} would refuse "
                         "them as the workers start); leave it out or use 'fork'")
    if timeout != 0:
        raise InputError(f"timeout={timeout!r}: stall detection is stall=StallPolicy(timeout_s={timeout!r}) here (it "
                         "restarts stalled worker processes at the exact position, or names the sample a thread is "
                         "stuck on)")
    if collate_fn is not None and isinstance(mode, InProcess) and mode.gathers(dataset):
        raise InputError(f"collate_fn: {who} gathers each batch of feature rows whole, with no list of samples to "
                         "collate; use num_workers=n (WorkerProcesses(n)) for a collate_fn, or change the batch in "
                         "your loop")


def _start_method(context: Any) -> str | None:
    """How ``context`` (a name, or a multiprocessing context) starts processes; None when not given."""
    if context is None or isinstance(context, str):
        return context
    get = getattr(context, "get_start_method", None)
    return get() if callable(get) else str(context)
