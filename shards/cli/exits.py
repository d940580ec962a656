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
        if args is None:  # the process's own command line: a console script, which ends when the command does
            _ENTRY.append(True)
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
    settle_on_signal()
    sys.exit(code)


def settle_on_signal() -> None:
    """The command's outcome is decided and said: a stop signal during the seconds it still takes to end (closing
    DataLoader workers, torch's teardown) no longer kills it, so it ends with its own exit code, not as killed by
    the signal (143), which a requeue script reads as a failure after the result was already printed.

    The signals are ignored, not handled: Python puts the default action back on every signal it handles as it
    finalizes, and the last second of torch's teardown comes after that; an ignored signal stays ignored. In a
    console script that starts at once. A command invoked in a process that goes on (a test's ``CliRunner``, a
    notebook) gets it only from an exit hook, so that process's signals stay as they were while it runs."""
    if _ENTRY:
        _ignore_stop_signals()
    elif not _HOOKED:
        _HOOKED.append(True)
        atexit.register(_ignore_stop_signals)


_HOOKED: list[bool] = []  # the exit hook is registered (once a process)
_ENTRY: list[bool] = []  # set when a command runs as the process's own command line (``OneLineUsage.main``)


def _ignore_stop_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
