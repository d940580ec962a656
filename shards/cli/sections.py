"""``--help`` in titled sections: a command with 50 options is read by what a user is deciding (data, model,
loader, ...), not as one flat list.

A command names its sections once, as titles mapped to parameter names, so shared option decorators
(``s3_options``, ``quiet_option``) need no section of their own: whatever no section names lands in the last
one. A name that no parameter has is an error when the command is built, so a renamed option cannot silently
fall out of its section.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import click


class SectionedCommand(click.Command):
    """A ``click.Command`` whose options print under titled sections, in the order given."""

    def __init__(self, *args: Any, sections: Mapping[str, Sequence[str]], rest: str = "Run", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sections = {title: tuple(names) for title, names in sections.items()}
        self.rest = rest
        known = {p.name for p in self.params}
        unknown = sorted(n for names in self.sections.values() for n in names if n not in known)
        if unknown:
            raise TypeError(f"{self.name}: --help sections name parameters the command does not have: {unknown}")
        placed = [n for names in self.sections.values() for n in names]
        twice = sorted({n for n in placed if placed.count(n) > 1})
        if twice:
            raise TypeError(f"{self.name}: --help sections name these parameters twice: {twice}")

    def section_of(self, name: str) -> str:
        for title, names in self.sections.items():
            if name in names:
                return title
        return self.rest

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows: dict[str, list[tuple[str, str]]] = {title: [] for title in (*self.sections, self.rest)}
        for param in self.get_params(ctx):
            if isinstance(param, click.Argument):
                continue  # arguments are in the usage line, as in click's own help
            record = param.get_help_record(ctx)
            if record is not None:
                rows[self.section_of(param.name or "")].append(record)
        for title, records in rows.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)
