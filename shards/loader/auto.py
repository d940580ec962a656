"""Run mode ``Auto``: try the candidate run modes for a few batches at the start of the first epoch, keep the one with
the lowest step time.

What matters to a training run is the time from one batch to the next as the training loop sees it: the wait for
data plus the step itself. A loader's own rate misleads: threads that decode fast can slow a CPU-bound step that
shares their cores (SPDL measured plain threads halving the step rate of such a model), and worker processes that
keep the cores busy can starve it the same way. So every candidate is timed on the real loop over
``trial_batches`` batches, its mean step time compared, the lowest kept for the rest of the run.

Only the steady state is timed. A candidate first feeds ``warmup_batches`` (processes starting, first reads) and
then as many batches as it prepares ahead (``RunMode.batches_ahead``: worker processes keep ``workers x
prefetch_factor`` batches queued): batches made while the loop was not yet asking come out of the queue at once,
and a short trial that counted them would crown the deepest queue, not the fastest loader.

A candidate clearly slower than one already timed is cut short: once it has ``CUT_AFTER`` timed steps whose mean
is over ``CUT_RATIO`` times the best finished candidate's (``cut_short``), its turn ends there. On a big node a
trial tries up to six candidates, each behind its warm-up and queue; the ones that cannot win stop paying for it.

When the two best are close (the second's mean step within ``runoff_percent`` of the first's), a runoff times both
again for ``trial_batches`` more each, the later-tried one first (A B ... B A: a load that drifts steadily over the
trial weighs on both alike), and the lower mean over both turns is kept (``runoff_pair``). Every turn starts with
its warm-up untimed; a candidate whose run was closed starts a fresh one for its second turn, its queue untimed too.

The trial changes nothing that is fed. The candidates share one epoch plan (``workers`` logical workers, the same
saved-state layout), and a switch is the loader's own exact resume in that layout (``state_dict`` of the batches
handed out, ``load_state_dict`` into the next candidate), so the batches are those of any one of the candidates run
alone. An epoch that ends inside the trial continues it in the next epoch.

Candidates: each kind (``Threads``, ``WorkerProcesses``) at each decode width, the number of threads or processes
decoding at once: its plain width (``n``, one per logical worker) and half and all of the usable CPUs
(``decode_widths``: at least 2, at most ``MAX_DECODE_WIDTH``), as ``Threads(n, decoders=w)`` (a pool of ``w`` decoding for the ``n``
worker threads) and ``WorkerProcesses(n, decoders=w // n)`` (``w // n >= 2`` threads in each process). The width is
what differs between a worker count that starves the step and one that feeds it (with 1 logical worker on 2 CPUs
the plain modes decode one image at a time); varying it through ``decoders``, not ``workers``, keeps the one plan,
so the trial still changes nothing that is fed. On a free-threaded build (the GIL off) threads come first. The
choice is a pure function of the measured step times (``choose``: the lowest mean, a tie to the earlier candidate). A
candidate that cannot run the dataset (threads and a transform that draws from torch's global generator) is left out.
The trial, the runoff's two (if any) and the choice are on ``loader.mode_choice()`` (``metrics.jsonl`` and the run
report carry them in ``train-from-shards``).
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterator

from shards.errors import InputError
from shards.jobs.parallel import usable_cpus
from shards.loader.base import Loader, Run, RunMode, restarted_by_watchdog
from shards.loader.threads import Threads
from shards.loader.worker_processes import WorkerProcesses
from shards.position.elastic import Continuation
from shards.position.resume import STREAM
from shards.procs.values import MAX_WORKERS

log = logging.getLogger(__name__)


def gil_enabled() -> bool:
    """Whether this interpreter runs with the GIL (always, before Python 3.13; on a free-threaded build, unless an
    extension module turned it back on)."""
    probe = getattr(sys, "_is_gil_enabled", None)
    return True if probe is None else bool(probe())


MAX_DECODE_WIDTH = 64  # decode threads a candidate runs at most, whatever the CPU count (WorkerProcesses' limit)


def decode_widths(cpus: int) -> list[int]:
    """The decode widths tried beside each kind's plain one: half and all of ``cpus``, at least 2 (one decoding
    thread is a plain mode's width), at most ``MAX_DECODE_WIDTH``; ascending, no repeats."""
    return sorted({min(MAX_DECODE_WIDTH, width) for width in (cpus // 2, cpus) if width >= 2})


def choose(steps: dict[RunMode, list[float]]) -> RunMode:
    """The candidate with the lowest mean step time (seconds per batch, as the loop saw them); a tie goes to the
    earlier candidate in ``steps``' order, and one never timed is never chosen, so the same measurements always
    give the same mode."""
    if not steps:
        raise InputError("Auto has no candidate to choose from: every run mode was unsuited to the dataset")
    return min(steps, key=lambda mode: mean_step(steps[mode]))


def runoff_pair(steps: dict[RunMode, list[float]], percent: int) -> list[RunMode]:
    """The two candidates with the lowest mean steps, in ``steps``' order, when the second's mean is within
    ``percent`` of the first's; empty otherwise (a clear winner, fewer than two timed, or ``percent`` 0).

    Why a runoff: two modes a few percent apart swap places between 10-batch trials on shared cores (processes and
    threads were 0-8% apart in the issue 45 rounds), and the run keeps whichever one its trial favoured for good.
    Timing both again, in the reverse order, doubles their samples and cancels a steady drift of the machine's load
    between the two turns."""
    timed = [c for c in steps if steps[c]]
    if percent <= 0 or len(timed) < 2:
        return []
    first, second = sorted(timed, key=lambda c: mean_step(steps[c]))[:2]  # sorted is stable: ties keep order
    if mean_step(steps[second]) > mean_step(steps[first]) * (1 + percent / 100):
        return []
    return [c for c in steps if c in (first, second)]


CUT_AFTER = 3  # timed steps a candidate gets before it may be cut short
CUT_RATIO = 1.5  # ... when its mean is over this many times the best finished candidate's


def cut_short(timed: list[float], finished: list[list[float]]) -> bool:
    """Whether a candidate's turn ends before its ``trial_batches``: it has ``CUT_AFTER`` timed steps, and their mean
    is over ``CUT_RATIO`` times the lowest mean among ``finished`` (the candidates that took their whole turn).

    Why 1.5x after 3: a cut candidate can never win (``choose`` keeps the lowest mean, and a runoff only takes two
    within ``runoff_percent``), so the cut must be far beyond the noise of three steps on shared cores (two passes of
    one mode differ by up to 8%, once 16%, in the issue 45 rounds); a candidate half again as slow as another is a
    kind or width that does not suit this node, and the rest of its turn would only delay the run."""
    best = min((mean_step(steps) for steps in finished if steps), default=float("inf"))
    return len(timed) >= CUT_AFTER and mean_step(timed) > CUT_RATIO * best


def mean_step(steps: list[float]) -> float:
    """The mean of a candidate's step times; infinite for one never timed."""
    return statistics.fmean(steps) if steps else float("inf")


@dataclass(frozen=True)
class Auto(RunMode):
    """Run mode: the candidate with the lowest step time over ``workers`` logical workers (see the module
    docstring); ``trial_batches`` timed per candidate, after ``warmup_batches`` and its queue's batches."""

    workers: int
    trial_batches: int = 10
    warmup_batches: int = 2
    runoff_percent: int = 10  # the two best within this many percent are timed again (0: never)

    kind = "auto"
    on_stall = "restart"  # a StallPolicy heals the process candidates; a thread candidate raises (Threads)

    def __post_init__(self) -> None:
        if type(self.workers) is not int or not 1 <= self.workers <= MAX_WORKERS:
            raise InputError(f"Auto workers must be an integer in 1..{MAX_WORKERS}, got {self.workers!r}")
        if type(self.warmup_batches) is not int or self.warmup_batches < 0:
            raise InputError(f"Auto warmup_batches must be an integer >= 0, got {self.warmup_batches!r}")
        if type(self.trial_batches) is not int or self.trial_batches < 1:
            raise InputError(f"Auto trial_batches must be an integer >= 1, got {self.trial_batches!r}")
        if type(self.runoff_percent) is not int or self.runoff_percent < 0:
            raise InputError(f"Auto runoff_percent must be an integer >= 0, got {self.runoff_percent!r}")

    def candidates(self, gil: bool | None = None, cpus: int | None = None) -> list[RunMode]:
        """The modes tried, in order (``gil``: whether the GIL is on, ``cpus``: usable CPUs; both default to this
        process's)."""
        gil = gil_enabled() if gil is None else gil
        cpus = usable_cpus() if cpus is None else cpus
        n = self.workers
        widths = decode_widths(cpus)
        threads: list[RunMode] = [Threads(n)] + [Threads(n, decoders=w) for w in widths if w > n]
        per_process = sorted({w // n for w in widths if w // n >= 2})
        processes: list[RunMode] = [WorkerProcesses(n)] + [WorkerProcesses(n, decoders=t) for t in per_process]
        return threads + processes if not gil else processes + threads

    def supervise(self, stall: Any, loader: Loader) -> Any:
        return restarted_by_watchdog(stall, loader)

    def layout(self, dataset: Any, batch_size: int) -> tuple[str, int]:
        return STREAM, batch_size

    def start(self, loader: Loader) -> Run:
        return AutoRun(loader, self)


class AutoRun(Run):
    """The trial, its runoff, then the chosen candidate's run (see the module docstring)."""

    def __init__(self, loader: Loader, mode: Auto):
        self._loader = weakref.ref(loader)  # a reference, not a proxy: the candidates' runs take the loader itself
        self.mode = mode
        self.candidates = [c for c in mode.candidates() if c.unsuited(loader.dataset) is None]
        self.runs: dict[RunMode, Run] = {}
        self.steps: dict[RunMode, list[tuple[float, float]]] = {c: [] for c in self.candidates}  # (step, wait)
        # The trial's turns: (candidate, how many timed steps it has once the turn ends); the runoff adds two.
        self.turns: list[tuple[RunMode, int]] = [(c, mode.trial_batches) for c in self.candidates]
        self.runoff: list[RunMode] = []
        self.cut: list[RunMode] = []  # the candidates whose turn ended early (``cut_short``)
        # Per candidate, the batch count up to which what it feeds is untimed: at each turn's start the warm-up, and
        # when its run starts anew what its queue held before the loop asked.
        self.untimed = dict.fromkeys(self.candidates, 0)
        self.taken = dict.fromkeys(self.candidates, 0)  # batches each candidate fed in the trial
        self.on_trial = 0  # index of the turn being taken
        self.started = -1  # index of the last turn started (an epoch's end inside a turn does not start it again)
        self.chosen: RunMode | None = None

    def _run(self, mode: RunMode) -> Run:
        if mode not in self.runs:
            self.runs[mode] = mode.start(self._loader())
        return self.runs[mode]

    def _start_turn(self, mode: RunMode) -> None:
        ahead = mode.batches_ahead if mode not in self.runs else 0  # a run going on asks for its batches as they come
        self.untimed[mode] = self.taken[mode] + self.mode.warmup_batches + ahead
        self.started = self.on_trial

    @property
    def current(self) -> RunMode:
        return self.chosen if self.chosen is not None else self.turns[self.on_trial][0]

    def batches(self) -> Iterator[Any]:
        if self.chosen is not None:
            yield from self._run(self.chosen).batches()
            return
        clock = time.perf_counter
        while self.chosen is None:
            mode, until = self.turns[self.on_trial]
            if self.started != self.on_trial:
                self._start_turn(mode)
            batches = self._run(mode).batches()
            timed = self.steps[mode]
            last = None  # an epoch that ended mid-trial: this candidate goes on where it stopped, timed afresh
            try:
                while len(timed) < until:
                    asked = clock()
                    try:
                        batch = next(batches)
                    except StopIteration:
                        return  # the epoch ended: the trial goes on in the next one
                    got = clock()
                    if last is not None and self.taken[mode] >= self.untimed[mode]:
                        timed.append((got - last, got - asked))  # step time: batch to batch; wait: for the data
                    last = got
                    self.taken[mode] += 1
                    yield batch
                    if not self.runoff and cut_short(*self._against(mode)):
                        self.cut.append(mode)
                        break
            finally:
                batches.close()
            self._next_turn(mode)
        yield from self._run(self.chosen).batches()

    def _next_turn(self, tried: RunMode) -> None:
        """Leave ``tried`` at the exact position: the next turn's candidate, or once the trial (and its runoff) is
        over the chosen one, continues the epoch from the loader's own state."""
        loader = self._loader()
        state = loader.position_state()
        if self.on_trial + 1 == len(self.turns) and not self.runoff:
            self.runoff = runoff_pair(self._step_times(), self.mode.runoff_percent)
            self.turns += [(c, 2 * self.mode.trial_batches) for c in reversed(self.runoff)]  # the later one first
        if self.on_trial + 1 < len(self.turns):
            self.on_trial += 1
        else:
            times = self._step_times()
            self.chosen = choose({c: times[c] for c in self.runoff} if self.runoff else times)
            against = [c for c in self.runoff if c != self.chosen]
            log.info("run mode: %s%s (mean step %s)", self.chosen,
                     f", after a runoff against {against[0]}" if against else "",
                     ", ".join(f"{c} {mean_step(times[c]) * 1000:.1f} ms{' (cut short)' if c in self.cut else ''}"
                               for c in self.candidates))
        if self.current != tried:
            self.runs.pop(tried).close()  # a candidate tried again in the runoff starts a fresh run
        loader.continue_from(state)  # the next iteration, whichever run makes it, starts at this batch
        if self.chosen is not None:
            for mode in [mode for mode in self.runs if mode != self.chosen]:
                self.runs.pop(mode).close()

    def _against(self, mode: RunMode) -> tuple[list[float], list[list[float]]]:
        """``mode``'s timed steps, and those of the candidates that finished their turn before it."""
        times = self._step_times()
        finished = [times[c] for c, _ in self.turns[:self.on_trial] if c not in self.cut]
        return times[mode], finished

    def _step_times(self) -> dict[RunMode, list[float]]:
        return {c: [step for step, _ in self.steps[c]] for c in self.candidates}

    def loaded(self, continued: Continuation) -> None:
        for run in self.runs.values():
            run.loaded(continued)

    def close(self) -> None:
        for run in self.runs.values():
            run.close()

    def choice(self) -> dict[str, Any] | None:
        """The trial so far (per candidate: batches timed, mean step and data-wait seconds), the candidates cut
        short, the runoff's two (empty when there was none, or none yet) and the mode chosen (None until the trial
        is over)."""
        trial = [{"mode": str(c), "batches": len(self.steps[c]),
                  "step_s": statistics.fmean(s for s, _ in self.steps[c]) if self.steps[c] else None,
                  "wait_s": statistics.fmean(w for _, w in self.steps[c]) if self.steps[c] else None}
                 for c in self.candidates]
        return {"trial": trial, "runoff": [str(c) for c in self.runoff], "cut": [str(c) for c in self.cut],
                "chosen": None if self.chosen is None else str(self.chosen)}
