"""Run one fuzz input through a reader within a time and a memory bound, and say what it did.

A reader given hostile bytes may do four wrong things: raise something other than a ``ShardcacheError``, take
unbounded time, take unbounded memory, or kill the process from C code (an abort or a segfault in a parser):

- Outcome: ``ok``, ``error`` (a ``ShardcacheError``), ``crash`` (any other exception, with its traceback),
  ``hang``, ``slow``, ``memory``, ``signal``.
- Time: the reader's CPU seconds are measured (wall time on a shared machine varies with the load, CPU time
  hardly); a reader is stopped where it is (the traceback names the loop) after ``CPU_STOP_S`` CPU seconds
  (``slow``) or ``HANG_S`` wall seconds (``hang``: waiting on something, a FIFO or a lock).
- Memory: the address space is capped while the reader runs (``RLIMIT_AS``: what the process had plus
  ``ADDRESS_BUDGET``), so a reader that trusts a declared size fails fast instead of swapping the machine; a
  ``MemoryError`` anywhere in the exception chain (even one a guard turned into a ``ShardcacheError``) and a peak
  resident growth above ``RSS_BUDGET`` (``VmHWM``, reset at the start with ``/proc/self/clear_refs``) are both
  memory blow-ups.
- Readers that call C parsers (h5py, pyarrow, ``torch.load``) run in a forked child (``isolate``), so an abort or a
  segfault is a finding (``signal``) instead of the end of the test run. The rest run in this process: a fork costs
  ~70 ms once torch is loaded, more than most readers take.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import resource
import select
import signal
import time
import traceback
from typing import Callable, Iterator

HANG_S = 30.0  # wall seconds before a reader is stopped as hung
CPU_STOP_S = 5.0  # CPU seconds before a reader is stopped (a finding past the caller's bound, 2 s in the suite)
KILL_GRACE_S = 10.0  # a forked reader that does not stop itself (a loop in C) is killed this much later
ADDRESS_BUDGET = 3 << 30  # address space a reader may add to what the process had at the fork
RSS_BUDGET = 512 << 20  # resident memory a reader may add: the artifacts are a few KB


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one run of a reader did. ``kind``: ok, error (a ShardcacheError), crash, signal, hang, memory, slow."""

    kind: str
    exception: str = ""  # the exception's type name (or the signal's name)
    message: str = ""
    where: str = ""  # the innermost frame of the traceback, ``file:line`` (groups findings)
    detail: str = ""  # the traceback
    cpu_s: float = 0.0
    rss_growth: int = 0

    @property
    def failed(self) -> bool:
        return self.kind not in ("ok", "error")

    def signature(self) -> str:
        """One finding per (kind, exception, place): what decides whether two failures are the same bug. A reader
        stopped for time is one finding wherever the timer caught it."""
        where = "" if self.kind in ("slow", "hang") else self.where
        return f"{self.kind}:{self.exception}:{where}"

    def describe(self) -> str:
        head = f"{self.kind}: {self.exception}: {self.message}".rstrip(": ")
        return f"{head}\n  at {self.where}\n{self.detail}" if self.detail else head


def _vm(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _innermost(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    frame = frames[-1]
    # The innermost frame in shardcache's own code is where the fix belongs; fall back to the innermost at all.
    for candidate in reversed(frames):
        if candidate.filename.startswith(root) and not any(part in candidate.filename
                                                               for part in ("/tests/", "/.venv/")):
            frame = candidate
            break
    return f"{os.path.relpath(frame.filename, root) if frame.filename.startswith(root) else frame.filename}:" \
           f"{frame.lineno}"


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def _classify(exc: BaseException, cpu_s: float) -> Outcome:
    from shards.errors import ShardcacheError

    chain = _chain(exc)
    memory = next((e for e in chain if isinstance(e, MemoryError)), None)
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    if memory is not None:
        return Outcome("memory", f"{type(exc).__name__} from MemoryError", text, _innermost(memory),
                       "".join(traceback.format_exception(memory)), cpu_s)
    if isinstance(exc, ShardcacheError):
        return Outcome("error", type(exc).__name__, text, "", "", cpu_s)
    return Outcome("crash", type(exc).__name__, text, _innermost(exc), "".join(traceback.format_exception(exc))[-4000:],
                   cpu_s)


class Hang(BaseException):
    """Raised into a running reader by a timer: ``slow`` past ``CPU_STOP_S`` of CPU, ``hang`` past ``HANG_S`` of
    wall time (``BaseException``, so a reader's ``except Exception`` cannot swallow it)."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


@contextlib.contextmanager
def _timers(cpu_stop_s: float, hang_s: float) -> Iterator[None]:
    """Stop the block with ``Hang`` once it has used ``cpu_stop_s`` of CPU or ``hang_s`` of wall time; the
    traceback then says where the reader was (a loop in C code is stopped only by the parent, see ``_forked``)."""
    def fire(kind: str) -> Callable[[int, object], None]:
        def handler(signum: int, frame: object) -> None:
            raise Hang(kind)
        return handler

    previous = {signal.SIGPROF: signal.signal(signal.SIGPROF, fire("slow")),
                signal.SIGALRM: signal.signal(signal.SIGALRM, fire("hang"))}
    signal.setitimer(signal.ITIMER_PROF, cpu_stop_s)
    signal.setitimer(signal.ITIMER_REAL, hang_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextlib.contextmanager
def _bounds() -> Iterator[Callable[[], int]]:
    """Cap the address space for the block, reset the resident high-water mark; yields the resident growth so far."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm("VmSize") + ADDRESS_BUDGET
    capped = soft == resource.RLIM_INFINITY or cap < soft
    if capped:
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset VmHWM to the current resident size
    except OSError:
        pass
    start_rss = _vm("VmRSS")
    try:
        yield lambda: _vm("VmHWM") - start_rss
    finally:
        if capped:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _measured(run: Callable[[], object], clock: Callable[[], float], hang_s: float) -> Outcome:
    """Run ``run`` within ``_bounds`` and ``_timers`` and classify what it did."""
    with _bounds() as growth:
        start = clock()
        try:
            with _timers(CPU_STOP_S, hang_s):
                run()
            outcome = Outcome("ok", cpu_s=clock() - start)
        except KeyboardInterrupt:
            raise
        except Hang as exc:
            spent = clock() - start
            what = f"stopped after {spent:.1f} CPU seconds" if exc.kind == "slow" else \
                f"still running after {hang_s:.0f} s (stopped)"
            outcome = Outcome(exc.kind, "timeout", what, _innermost(exc),
                              "".join(traceback.format_exception(exc))[-4000:], spent)
        except BaseException as exc:  # noqa: BLE001 - classifying every exception is the point
            outcome = _classify(exc, clock() - start)
        grown = growth()
    outcome = dataclasses.replace(outcome, rss_growth=grown)
    if grown > RSS_BUDGET and not outcome.failed:
        outcome = dataclasses.replace(outcome, kind="memory", exception="resident growth",
                                      message=f"{grown >> 20} MiB resident on top of the process")
    return outcome


def _child(run: Callable[[], object], write_fd: int, hang_s: float) -> None:
    """The forked child: run ``run`` bounded, report (length first). Never returns."""
    try:
        payload = pickle.dumps(_measured(run, time.process_time, hang_s))
    except BaseException as exc:  # noqa: BLE001
        payload = pickle.dumps(Outcome("crash", type(exc).__name__, f"fuzz harness: {exc}", "harness"))
    try:
        view = memoryview(len(payload).to_bytes(8, "little") + payload)
        while view:
            view = view[os.write(write_fd, view):]
    finally:
        os._exit(0)


_ZOMBIES: list[int] = []


def _reap() -> None:
    for pid in list(_ZOMBIES):
        if os.waitpid(pid, os.WNOHANG)[0]:
            _ZOMBIES.remove(pid)


def _forked(run: Callable[[], object], hang_s: float) -> Outcome:
    """``run`` in a forked child. The parent reads the report and leaves the child to exit on its own (tearing
    down a process that has torch loaded takes tens of milliseconds); a child that dies first is waited for."""
    _reap()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(run, write_fd, hang_s)
    os.close(write_fd)
    data = b""
    deadline = time.monotonic() + hang_s + KILL_GRACE_S
    hung = False
    try:
        while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "little"):
            left = deadline - time.monotonic()
            if left <= 0:
                hung = True
                break
            if select.select([read_fd], [], [], left)[0]:
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(read_fd)
    if hung:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return Outcome("hang", "timeout", f"still running after {hang_s + KILL_GRACE_S:.0f} s (killed)", "?")
    if len(data) >= 8 and len(data) == 8 + int.from_bytes(data[:8], "little"):
        _ZOMBIES.append(pid)
        return pickle.loads(data[8:])
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        return Outcome("signal", name, f"the reader's process was killed by {name}", "?")
    return Outcome("crash", "no report", f"the child exited with status {status} without a report", "?")


def _in_process(run: Callable[[], object], hang_s: float) -> Outcome:
    """``run`` in this process (no fork: it costs ~70 ms with torch loaded). For readers of pure Python; C parsers
    that may abort run ``_forked``."""
    return _measured(run, time.thread_time, hang_s)


def run_bounded(run: Callable[[], object], *, cpu_limit_s: float, isolate: bool = True,
                hang_s: float = HANG_S) -> Outcome:
    """``run()`` within the bounds, in a forked child when ``isolate`` (see the module docstring)."""
    outcome = _forked(run, hang_s) if isolate else _in_process(run, hang_s)
    if not outcome.failed and outcome.cpu_s > cpu_limit_s:
        outcome = dataclasses.replace(outcome, kind="slow", exception="time",
                                      message=f"{outcome.cpu_s:.2f} CPU seconds (bound {cpu_limit_s:g} s)",
                                      where="?")
    return outcome
