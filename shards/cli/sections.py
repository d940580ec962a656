"""``--help`` in titled sections: a command with 50 options is read by what a user is deciding (data, model,
loader, ...), not as one flat list.

A command names its sections once, as titles mapped to parameter names, so shared option decorators
(``s3_options``, ``quiet_option``) need no section of their own: whatever no section names lands in the last
one. A name that no parameter has is an error when the command is built, so a renamed option cannot silently
fall out of its section.

The options a user reaches for first (``common``) print first, under their own title, whatever section they
belong to, and ``examples`` (full command lines) print right after the description: a 200-line ``--help`` is
read from the top.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import click

from shards.cli.exits import OneLineUsage


COMMON_TITLE = "Most used"


class SectionedCommand(OneLineUsage, click.Command):
    """A ``click.Command`` whose options print under titled sections, in the order given, after the ``common``
    ones; ``examples`` print after the description."""

    def __init__(self, *args: Any, sections: Mapping[str, Sequence[str]], rest: str = "Run",
                 common: Sequence[str] = (), examples: Sequence[str] = (), **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sections = {title: tuple(names) for title, names in sections.items()}
        self.rest = rest
        self.common = tuple(common)
        self.examples = tuple(examples)
        known = {p.name for p in self.params}
        unknown = sorted(n for names in (*self.sections.values(), self.common) for n in names if n not in known)
        if unknown:
            raise TypeError(f"{self.name}: --help sections name parameters the command does not have: {unknown}")
        placed = [n for names in self.sections.values() for n in names]
        twice = sorted({n for n in placed if placed.count(n) > 1})
        if twice:
            raise TypeError(f"{self.name}: --help sections name these parameters twice: {twice}")

    def section_of(self, name: str) -> str:
        if name in self.common:
            return COMMON_TITLE
        for title, names in self.sections.items():
            if name in names:
                return title
        return self.rest

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list[tuple[str, str]]] = {title: [] for title in (COMMON_TITLE, *self.sections, self.rest)}
        common: dict[str, tuple[str, str]] = {}
        for param in self.get_params(ctx):
            if isinstance(param, click.Argument):
                continue  # arguments are in the usage line, as in click's own help
            record = param.get_help_record(ctx)
            if record is not None and param.name in self.common:
                common[param.name] = record
            elif record is not None:
                rows[self.section_of(param.name or "")].append(record)
        rows[COMMON_TITLE] = [common[name] for name in self.common if name in common]  # in the order given
        for title, records in rows.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        super().format_help_text(ctx, formatter)
        if self.examples:
            with formatter.section("Examples"):
                for line in self.examples:
                    formatter.write(f"{'':>{formatter.current_indent}}{line}\n")
