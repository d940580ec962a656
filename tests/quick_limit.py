"""The quick loop's half-second rule, enforced: a session run with ``-m "not slow"`` (``scripts/test -m "not
slow"``) fails when any test's call phase took longer than the limit, one line per test naming it, its time and the
fix (mark it ``slow``, or make it cheaper).

Only the call phase counts: a module- or session-scoped fixture's setup is paid once by whichever test comes first,
and under xdist that is an accident of scheduling, not the test's cost. The limit is 0.5 s; a loaded machine (two
cores shared with other work) can raise it with ``--quick-limit SECONDS`` or ``SHARDCACHE_QUICK_LIMIT=SECONDS``
(the option wins), and ``0`` turns the check off. CI runs the full suite, where the rule does not apply.

On two cores shared by two xdist workers a test of 0.3 s is sometimes timed at 0.6: one slow timing is noise as
often as a regression. So where pytest's cache is on, a test fails the session only when it was over the limit in
this quick run and the one before (the cache keeps the last run's names); once is a warning line. Without the cache
(``-p no:cacheprovider``) one run decides.
"""

from __future__ import annotations

import os
import re

import pytest

DEFAULT_LIMIT_S = 0.5
LIMIT_ENV = "SHARDCACHE_QUICK_LIMIT"
# "not slow" as a term of the -m expression: "not slow", "not slow and not s3", "(not slow) and unit".
_QUICK = re.compile(r"(?<![\w.])not\s+slow(?![\w.])")


def is_quick_loop(markexpr: str | None) -> bool:
    """Whether ``-m`` selects the quick loop: the expression leaves out the tests marked slow."""
    return bool(markexpr) and _QUICK.search(markexpr) is not None


def limit_from(option: str | None, environ: dict[str, str]) -> float:
    """The limit in seconds: ``--quick-limit``, else ``$SHARDCACHE_QUICK_LIMIT``, else 0.5 (0: no check)."""
    for where, text in (("--quick-limit", option), (LIMIT_ENV, environ.get(LIMIT_ENV))):
        if text is None or text == "":
            continue
        try:
            seconds = float(text)
        except ValueError:
            raise pytest.UsageError(f"{where}={text!r} is not a number of seconds") from None
        if seconds < 0:
            raise pytest.UsageError(f"{where}={text!r}: a limit is 0 (off) or more seconds")
        return seconds
    return DEFAULT_LIMIT_S


def over_limit(call_seconds: dict[str, float], limit_s: float) -> list[str]:
    """One line per test whose call phase took longer than ``limit_s``, slowest first (none when the limit is 0)."""
    if limit_s <= 0:
        return []
    slow = sorted(((s, nodeid) for nodeid, s in call_seconds.items() if s > limit_s), key=lambda row: (-row[0], row[1]))
    return [f"{nodeid} took {seconds:.2f} s in the quick loop (limit {limit_s:g} s): mark it "
            f"@pytest.mark.slow or make it cheaper" for seconds, nodeid in slow]


def add_option(parser: pytest.Parser) -> None:
    parser.addoption("--quick-limit", default=None, metavar="SECONDS",
                     help=f"Under -m 'not slow', fail the session if a test's call phase takes longer (default "
                          f"${LIMIT_ENV}, else {DEFAULT_LIMIT_S}; 0: off).")


class QuickLimit:
    """The plugin: collects call-phase durations where reports arrive (the xdist controller, or the one process)
    and turns a passing session into a failing one when a test broke the limit."""

    CACHE_KEY = "shardcache/quick-over-limit"

    def __init__(self, limit_s: float, cache: object | None = None):
        self.limit_s, self.cache = limit_s, cache
        self.call_seconds: dict[str, float] = {}
        self.lines: list[str] = []
        self.once: list[str] = []

    @classmethod
    def configure(cls, config: pytest.Config) -> None:
        """Register the check for a quick-loop session, in the process that sees every report (not an xdist
        worker, whose reports its controller receives)."""
        if hasattr(config, "workerinput") or not is_quick_loop(config.getoption("markexpr", None)):
            return
        limit_s = limit_from(config.getoption("quick_limit", None), dict(os.environ))
        if limit_s > 0:
            config.pluginmanager.register(cls(limit_s, getattr(config, "cache", None)), "shardcache-quick-limit")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call":
            self.call_seconds[report.nodeid] = report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        over = {nodeid: s for nodeid, s in self.call_seconds.items() if s > self.limit_s}
        failing = over
        if self.cache is not None:
            before = set(self.cache.get(self.CACHE_KEY, []))
            self.cache.set(self.CACHE_KEY, sorted(over))
            failing = {nodeid: s for nodeid, s in over.items() if nodeid in before}
        self.lines = over_limit(failing, self.limit_s)
        self.once = [f"{line} (over once: the next quick run fails if it is again)"
                     for line in over_limit({k: v for k, v in over.items() if k not in failing}, self.limit_s)]
        if self.lines and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.once:
            terminalreporter.section("quick tests over the limit once", sep="=", yellow=True)
            for line in self.once:
                terminalreporter.write_line(line)
        if self.lines:
            terminalreporter.section("quick tests over the limit", sep="=", red=True, bold=True)
            for line in self.lines:
                terminalreporter.write_line(line)
