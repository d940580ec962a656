"""The one loader of a shardcache dataset, and what a run mode must provide to it.

A ``Loader`` is the same object whatever makes its batches: it owns the position (a ``Cursor``,
``shards.position.cursor``: batches handed out, a loaded state, the quarantine), the epoch, ``state_dict`` /
``load_state_dict`` (which Lightning and accelerate call; ``dcp_state()`` for ``torch.distributed.checkpoint``),
the stage seconds, stall recovery (``StallPolicy``) and where its faults are reported, so a training loop, a
checkpoint or a trainer integration never asks which way it runs (docs/integrations.md).

How batches are made is a value, the loader's run mode (``RunMode``): ``WorkerProcesses`` (DataLoader worker
processes, ``shards.loader.worker_processes``), ``Threads`` (a pool of threads in this process,
``shards.loader.threads``), ``InProcess`` (``shards.loader.in_process``) or ``Auto`` (the one of those with the lowest
step time, ``shards.loader.auto``). A mode says which saved-state layout its batch count means and builds the ``Run``
that yields the current epoch's batches from the cursor's position; a new way of running is one new mode class, with
no branch here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import fields, replace
from typing import Any, Callable, ClassVar, Iterator

import numpy as np

from shards.errors import InputError
from shards.loader.budget import MemoryBudget
from shards.loader.mode_spelling import parse_mode
from shards.procs.stage_times import SharedStageTimes
from shards.loader.resume_audit import (
    ResumeAudit, check_state, fed_batches, last_verdict, resume_verdict, saved_with_audit,
)
from shards.loader.watchdog import StallPolicy, Watchdog, check_stack_dir
from shards.position.audit import check_mode
from shards.position.cursor import Cursor
from shards.position.dcp_state import DcpLoaderState
from shards.position.elastic import EXCLUDED, Continuation, SavedState
from shards.position.lineage import batch_rows, row_samples
from shards.position.resume import worker_batches


class Run(ABC):
    """One loader's way of making batches, built by its mode for that loader; the loader drives it."""

    @abstractmethod
    def batches(self) -> Iterator[Any]:
        """The current epoch's batches from the cursor's position (``cursor.begin()``), counting each one handed
        out in ``cursor.handed``."""

    def loaded(self, continued: Continuation) -> None:
        """A state was loaded into the cursor (``continued`` starts at the next iteration)."""

    def close(self) -> None:
        """Stop what runs beside the caller now; iterating again starts afresh."""

    def choice(self) -> dict[str, Any] | None:
        """What a mode that chooses among others (``Auto``) tried and chose; None for a fixed mode."""
        return None

    def ahead_within_budget(self, asked: int) -> int:
        """Batches a consumer may prefetch beside this run (train's feature prefetch thread) within the loader's
        memory budget, at most ``asked``; a run that fits its own queues to the budget leaves ``asked``."""
        return asked


def check_batchable(dataset: Any, collate_fn: Callable | None) -> None:
    """Refuse PIL images (the standard decoder with no transform) to the default collate in one line naming the
    fixes: torch's ``default_collate`` stopped at the first batch, with a traceback from inside a worker."""
    from shards.image.decode import ImageDecoder

    decoder = getattr(dataset, "decoder", None)
    if collate_fn is None and type(decoder) is ImageDecoder and decoder.transform is None:
        raise InputError("the dataset yields PIL images (open_dataset without a transform), which no batch holds: "
                         "give open_dataset a transform (transform='eval' or 'train', or a torchvision transform "
                         "ending in ToTensor/PILToTensor), or make_loader collate_fn=shards.pad_collate")


class RunMode(ABC):
    """How a loader runs: a frozen value (compared, printed, saved in a config) that builds the loader's ``Run``.

    ``workers``: the logical workers of the epoch plan it runs (processes or threads; part of a saved state's
    layout, so modes with the same count feed the same batches and resume each other's states); ``on_stall``:
    what a ``StallPolicy`` does in it (``supervise`` builds that): ``"restart"`` (worker processes are killed and
    restarted at the position), ``"raise"`` (a thread cannot be killed: an error naming the sample and the stack),
    None (refused).

    One spelling everywhere (``shards.loader.mode_spelling``): ``RunMode.parse(text | dict | int)`` reads the CLI's text
    (``"processes:4,decoders=2"``), the JSON form ``to_json()`` writes (``{"kind": "processes", "workers": 4,
    ...}``, what configs and run records keep) and a bare worker count (older records); ``kind`` names the mode
    in both. Options mean the same in every mode that has them: ``prefetch`` (batches each worker prepares
    ahead), ``decoders`` (threads that decode beside the readers, 0: each worker decodes its own samples)."""

    kind: ClassVar[str] = ""
    # Option names of older spellings -> the one-line answer naming this spelling (``parse`` and the keywords).
    RENAMED: ClassVar[dict[str, str]] = {}
    workers: int = 0
    on_stall: str | None = None

    # kind -> mode class: each mode joins when its class is defined (the package imports every mode, so a parse
    # sees them all); the spelling reads kinds from here and imports no mode (``shards.loader.mode_spelling``).
    KINDS: ClassVar[dict[str, type["RunMode"]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("kind"):  # a class naming its own kind; a subclass of a mode never takes its place
            RunMode.KINDS[cls.kind] = cls

    @classmethod
    def parse(cls, value: Any) -> "RunMode":
        """The run mode ``value`` spells (see the class docstring); an ``InputError`` naming what is wrong."""
        return parse_mode(value, RunMode.KINDS)

    def to_json(self) -> dict[str, Any]:
        """``{"kind": ..., <field>: <value>, ...}``: the one JSON form, which ``parse`` reads back to an equal mode."""
        return {"kind": self.kind, **{item.name: getattr(self, item.name) for item in fields(self)}}

    @property
    def batches_ahead(self) -> int:
        """Batches this mode prepares ahead of the loop at most (its queues' depth)."""
        return 0

    @property
    def restarts_each_epoch(self) -> bool:
        """Whether each epoch's readers start anew (worker processes that do not persist), so each loads its
        byte indexes again (the forecast counts those reads)."""
        return False

    def supervise(self, stall: StallPolicy | None, loader: Loader) -> Watchdog | None:
        """What watches ``loader``'s workers under ``stall``: the watchdog that restarts them, or None where the run
        watches itself (threads raise) or ``stall`` is None. A mode with nothing beside the loop refuses a policy."""
        if stall is not None:
            raise InputError(f"stall recovery (StallPolicy) watches worker processes or threads, and {self} runs "
                             "none: use WorkerProcesses(n) or Threads(n), or leave stall unset")
        return None

    @abstractmethod
    def layout(self, dataset: Any, batch_size: int) -> tuple[str, int]:
        """``(kind, split_batch)`` of this mode over ``dataset``: which saved-state layout a batch count means
        (``shards.position.resume``) and the unit the epoch plan splits a rank's share between workers in."""

    @abstractmethod
    def start(self, loader: Loader) -> Run:
        """The run that makes ``loader``'s batches (called once, when the loader is made)."""

    def unsuited(self, dataset: Any) -> str | None:
        """Why this mode cannot run ``dataset`` (``start`` refuses it then; ``Auto`` leaves the mode out), or None."""
        return None


def restarted_by_watchdog(stall: StallPolicy | None, loader: Loader) -> Watchdog | None:
    """``supervise`` of a mode whose worker processes a watchdog restarts (``WorkerProcesses``, ``Auto``)."""
    return None if stall is None else Watchdog(stall, loader.dataset, loader.cursor)


def checked_arguments(batch_size: Any, mode: Any) -> int:
    """``batch_size`` as an ``int``, if it and ``mode`` are what a ``Loader`` takes; else an ``InputError`` naming
    which and why (checked before anything is built from them)."""
    if batch_size is None:
        raise InputError("batch_size=None (DataLoader's unbatched samples) is not a loader here: iterate the "
                         "dataset itself for one sample at a time, or give batch_size >= 1")
    if isinstance(batch_size, bool) or not hasattr(batch_size, "__index__") or batch_size < 1:
        raise InputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not isinstance(mode, RunMode):
        raise InputError(f"mode must be a run mode (WorkerProcesses(n), Threads(n), InProcess() or Auto()), got "
                         f"{mode!r}")
    return batch_size.__index__()


class Loader:
    """Batches of a dataset of ``open_dataset`` in one run ``mode`` (usually made by ``make_loader``).

    Iteration over the epoch's batches, ``len`` right for the rank, ``set_epoch``/``epoch`` (also as
    ``sampler.set_epoch``, Lightning's way), ``state_dict``/``load_state_dict`` (the ``Stateful`` protocol),
    ``dcp_state()``, ``stage_seconds()``, ``quarantined`` and ``report_faults``, in every mode.

    ``stall``: stall and crash recovery (``shards.loader.watchdog``): worker processes are restarted, threads end
    the run with an error naming the sample and its stack; a mode with nothing beside the loop to watch refuses it
    (an ``InputError`` naming the mode), never ignores it. ``stage_times=False``: no stage seconds (they
    stay at 0), for measuring what they cost. ``collate_fn`` and ``pin_memory`` apply in every mode that makes
    batches from samples; ``worker_init_fn``, ``multiprocessing_context`` and ``generator`` go to the DataLoader of a
    mode that makes one. ``resume_audit``: what a loaded state whose recorded batches disagree
    with the plan does (``shards.position.audit``): ``"refuse"`` (a ``ResumeAuditError``), ``"warn"`` (one
    logged line) or ``"off"`` (no audit record is saved or checked). ``memory``: the ``MemoryBudget`` a run mode
    fits its prefetch depth to (``shards.loader.budget``; None: the depths the mode says)."""

    def __init__(self, dataset: Any, batch_size: int, mode: RunMode, *, drop_last: bool = False,
                 stall: StallPolicy | None = None, stage_times: bool = True, collate_fn: Callable | None = None,
                 pin_memory: bool = False, resume_audit: str = "refuse", worker_init_fn: Callable | None = None,
                 multiprocessing_context: Any = None, generator: Any = None, memory: MemoryBudget | None = None):
        batch_size = checked_arguments(batch_size, mode)
        self.dataset = dataset
        self.batch_size = batch_size
        self.mode = mode
        self.memory = memory  # bytes in flight at most (``shards.loader.budget``); None: as the mode's depths say
        self.drop_last = drop_last
        self.collate_fn, self.pin_memory = collate_fn, pin_memory
        # What the DataLoader of a mode that makes one takes besides (``make_loader`` checks them against the mode).
        self.dataloader_options = {"worker_init_fn": worker_init_fn, "multiprocessing_context": multiprocessing_context,
                                   "generator": generator}
        kind, split_batch = mode.layout(dataset, batch_size)
        self.cursor = Cursor(dataset, kind, batch_size=batch_size, num_workers=mode.workers, drop_last=drop_last,
                             split_batch=split_batch)
        self._stage_times = SharedStageTimes()
        self.stage_times = self._stage_times if stage_times else None  # where a run adds its stage seconds
        self.stall = stall
        self.watchdog = mode.supervise(stall, self)  # after the cursor: a watchdog watches its position
        self.audit = None if check_mode(resume_audit) == "off" else ResumeAudit(self, resume_audit)
        self.run = mode.start(self)

    @property
    def num_workers(self) -> int:
        return self.mode.workers

    def __iter__(self) -> Iterator[Any]:
        # A generator of the loader's own, so an iteration keeps its loader alive (``next(iter(make_loader(...)))``);
        # the run refers back to its loader only weakly.
        check_batchable(self.dataset, self.collate_fn)
        yield from fed_batches(self.audit, self.run.batches)

    def __len__(self) -> int:
        """Batches of this epoch, counting those handed out before a resume in another layout."""
        return self.cursor.batches_before() + sum(self.batches_per_worker())

    def batches_per_worker(self) -> list[int]:
        """Batches each (logical) worker yields this epoch (of the remainder, in an epoch continued in another
        layout): whole batches, and at most one partial batch per rank."""
        return worker_batches(self.cursor.rank_samples(), self.num_workers, self.batch_size, self.drop_last,
                              self.cursor.split_batch)

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def mode_choice(self) -> dict[str, Any] | None:
        """``Auto``'s trial (per candidate: batches timed, mean step and data-wait seconds) and the mode it chose
        (None until every candidate was tried); None in a fixed mode."""
        return self.run.choice()

    def prefetch_within_budget(self, asked: int) -> int:
        """How many batches a consumer may hold ahead of the step beside this loader (a prefetch thread), at most
        ``asked``, within ``memory`` (``shards.loader.budget``)."""
        return self.run.ahead_within_budget(asked)

    def close(self) -> None:
        """Stop what the loader runs beside the caller (worker processes) now, rather than when the garbage
        collector reaches it. Iterating again starts afresh. Also ``with make_loader(...) as loader:``."""
        self.run.close()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    @property
    def sampler(self) -> Any:
        """What a trainer that drives a loader like a DataLoader calls ``set_epoch`` on at each epoch's start: the
        dataset, whose epoch decides the order. Lightning's fit loop sets the epoch only through ``loader.sampler``,
        so without this every epoch of ``Trainer.fit`` would repeat epoch 0's order (docs/integrations.md)."""
        return self.dataset

    # -- position ----------------------------------------------------------------------------------------------------
    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """The position in the current epoch: after the batches handed out, or after ``batches_consumed`` of them
        when the consumer lags behind (a prefetcher that drew batches the training step has not used); with the
        quarantine, and the rows the dataset leaves out (``exclude_rows``), which a resume with others replays
        (``elastic``), and the resume audit's record of the batches fed and to come (``shards.position.audit``)."""
        return saved_with_audit(self, self.position_state(batches_consumed), batches_consumed)

    def position_state(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """``state_dict`` without the audit record: the loader's own position, for a run mode's switch or restart
        within the process (``Auto``, the watchdog), where there is nothing to audit."""
        state = self.cursor.state_dict(batches_consumed)
        if self.dataset.excluded is not None:
            state[EXCLUDED] = self.dataset.excluded.tolist()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch at the next batch it had not yet handed out: in the same layout exactly as the
        interrupted run would have, in another (world size, workers, batch size) with exactly the samples the
        interrupted epoch had not yet yielded; the saved quarantine is kept out from then on. The state's audit
        record is checked against the plan first (``resume_audit``), and the first batches fed after it too. The
        state is parsed here, once (``SavedState.parse``); only the typed value goes on."""
        saved = SavedState.parse(state)
        checked = self.cursor.checked(saved)
        verdict = resume_verdict(self, saved)  # refused before anything changes
        continued = self.cursor.apply(checked)
        self.run.loaded(continued)
        if self.audit is not None:
            self.audit.loaded(saved, continued, verdict)

    def continue_from(self, state: dict[str, Any]) -> Continuation:
        """``load_state_dict`` without the audit: a state this loader saved itself in this process."""
        continued = self.cursor.load(SavedState.parse(state))
        self.run.loaded(continued)
        if self.audit is not None:
            self.audit.switched(continued.position.batches)
        return continued

    def resume_audit_result(self) -> dict[str, Any]:
        """The audit of the last state loaded: ``{"result": "ok" | "mismatch" | "not audited" | "off", ...}``
        (``"message"`` naming the first mismatch), or ``{"result": "off"}`` with the audit off; ``{}`` before any
        state was loaded."""
        return last_verdict(self)

    def audit_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The audit of saved ``state`` against this loader's dataset and plan, without loading it (``shards
        audit``), whatever the loader's own ``resume_audit``."""
        return check_state(self, SavedState.parse(state))

    def dcp_state(self) -> DcpLoaderState:
        """This loader's position as ``torch.distributed.checkpoint`` saves and loads it
        (``shards.position.dcp_state``): ``dcp.save({"data": loader.dcp_state(), ...})`` on every rank; ``dcp.load``
        the same on a run of any world size continues the epoch there."""
        return DcpLoaderState(self)

    @property
    def quarantined(self) -> tuple[tuple[int, str], ...]:
        """Samples kept out of every epoch as sorted ``(global row, key)`` pairs: a worker hung or died on each
        twice (``shards.loader.watchdog``), or a loaded state carried them. Empty in a mode with no workers to
        hang, unless a loaded state carried some."""
        return self.cursor.quarantined

    def keep_out(self, samples: dict[int, str]) -> None:
        """Quarantine ``samples`` (global row -> key) from the next epoch on, as the watchdog would have: a replay of
        a run's quarantine events (``train.run.lineage``)."""
        self.cursor.keep_out(samples)

    def batch_keys(self, epoch: int, step: int) -> list[dict[str, Any]]:
        """The samples of batch ``step`` (from 0, within the epoch) of ``epoch`` (from 0, as ``set_epoch``) on this
        rank: ``{"key", "shard", "row"}`` each, ``"stand_in": True`` on a quarantined row (another sample was fed
        in its place). Computed from the order (``shards.position.lineage``), not recorded: an epoch continued from
        a loaded state (in this layout or another) is answered as it was fed while it is the current epoch."""
        return row_samples(self.dataset, self.batch_rows(epoch, step), self.cursor.quarantine)

    def batch_rows(self, epoch: int, step: int) -> np.ndarray:
        """The global rows of batch ``step`` of ``epoch`` on this rank, in the batch's order (``batch_keys``)."""
        remainder = self.cursor.remainder()
        if remainder is not None and remainder.position.epoch == epoch:
            position = remainder.position
        else:
            position = replace(self.cursor.position(0), epoch=epoch, prior=None)
        return batch_rows(self.dataset.epoch_source(), position, self.dataset.config.rank, step)

    # -- faults and time ---------------------------------------------------------------------------------------------
    def report_faults(self, stack_dir: str | None, on_event: Callable[[dict], Any] | None) -> None:
        """Where stall recovery writes stack dumps and sends its events, for a caller that knows only after making
        the loader (a trainer's run folder); the folder is checked now. Without a ``StallPolicy`` there are no
        faults to report. ``on_event`` also hears the resume audit's check of the first batches after a resume."""
        checked = None if stack_dir is None else check_stack_dir(stack_dir)
        if self.audit is not None:
            self.audit.on_event = on_event  # the check of the batches fed after a resume
        if self.stall is not None:
            self.stall = replace(self.stall, stack_dir=checked, on_event=on_event)
        if self.watchdog is not None:
            self.watchdog.stack_dir, self.watchdog.on_event = checked, on_event

    def stage_seconds(self) -> dict[str, float]:
        """This rank's busy seconds per worker stage (``read``, ``decode``, ``transform``, ``collate``), summed over
        its workers and all epochs since the last ``reset_stage_seconds``; a consumer takes differences per epoch.
        An in-process run of ready feature rows has only ``read`` (``shards.loader.in_process``)."""
        return self._stage_times.snapshot()

    def reset_stage_seconds(self) -> None:
        self._stage_times.reset()
