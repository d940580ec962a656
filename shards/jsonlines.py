"""JSON Lines, parsed one line at a time: what each caller does with a bad line (refuse, or leave it out) is its own.

Image lists, source indexes and ``metrics.jsonl`` are all JSON Lines, and all may come from elsewhere; each names
the line a problem is on.
"""

from __future__ import annotations

import json
from typing import Any, Iterator


def json_lines(text: str) -> Iterator[tuple[int, Any, str | None]]:
    """``(line number, value, None)`` for each non-blank line, or ``(line number, None, why)`` when it is not
    JSON; line numbers count from 1, blank lines included."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line), None
        except json.JSONDecodeError as exc:
            yield number, None, exc.msg
