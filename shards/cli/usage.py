"""Usage errors in one line: ``error: <what is wrong> (see 'pack-shards --help')``, exit 2.

click prints a usage error as three lines (the usage, a "Try --help" line, the error), where every other refusal
here is one ``error:`` line a log or a scheduler's mail shows whole; a script that greps for ``error:`` found
nothing. Every console script's command class takes this mixin, so its option errors read as its input errors do.
"""

from __future__ import annotations

import sys
from typing import Any

import click


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
