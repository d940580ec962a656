"""How a console script ends: usage errors in one line, and its exit code kept through a late stop signal.

click prints a usage error as three lines (the usage, a "Try --help" line, the error), where every other refusal
here is one ``error:`` line a log or a scheduler's mail shows whole; a script that greps for ``error:`` found
nothing. Every console script's command class takes ``OneLineUsage``, so its option errors read as its input
errors do: ``error: <what is wrong> (see 'pack-shards --help')``, exit 2.

Once a command's outcome is decided and said (``settle``), a stop signal during the interpreter's teardown ends
the process with that outcome's code.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from typing import Any

import click

from shards.jobs.preemption import STOP_SIGNALS


class OneLineUsage:
    """A mixin for a ``click.Command`` (or ``Group``): its usage errors, and click's other errors, in one line."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)  # type: ignore[misc]
        try:
            value = super().main(args, prog_name, complete_var, False, **extra)  # type: ignore[misc]
        except click.UsageError as exc:
            path = exc.ctx.command_path if exc.ctx is not None else (prog_name or "")
            click.echo(f"error: {exc.format_message()} (see '{path} --help')", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(value if isinstance(value, int) else 0)  # click's own exits (--help, --version) return their code


def settle(code: int) -> None:
    """Exit with ``code``, a stop signal during the exit included (``settle_on_signal``)."""
    settle_on_signal(code)
    sys.exit(code)


def settle_on_signal(code: int) -> None:
    """The command's outcome is decided and said: a stop signal during the interpreter's teardown (which torch makes
    take seconds) ends the process with ``code``, not as killed by the signal (143), which a requeue script reads
    as a failure after the result was already printed.

    The handlers go in when the teardown starts (an exit hook registered after torch's, so it runs before them):
    a command invoked in a process that goes on (a test, a notebook) leaves that process's signals as they were."""
    _OUTCOME[:] = [code]
    if not _OUTCOME_HOOKED:
        _OUTCOME_HOOKED.append(True)
        atexit.register(_leave_on_stop_signals)


_OUTCOME: list[int] = []  # the exit code of the last command settled in this process
_OUTCOME_HOOKED: list[bool] = []


def _leave_on_stop_signals() -> None:
    if threading.current_thread() is not threading.main_thread() or not _OUTCOME:
        return
    code = _OUTCOME[0]

    def leave(signum: int, frame: object) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    for sig in STOP_SIGNALS:
        signal.signal(sig, leave)
