"""JSON Lines, parsed one line at a time: what each caller does with a bad line (refuse, or leave it out) is its own.

Image lists, source indexes and ``metrics.jsonl`` are all JSON Lines, and all may come from elsewhere; each names
the line a problem is on. Each line is parsed by ``shards.door.bounded_read.parse_json``, so a line nested too deep is a
bad line like a malformed one, never a ``RecursionError``.
"""

from __future__ import annotations

from typing import Any, Iterator

from shards.door.bounded_read import JSONError, parse_json


def json_lines(text: str, *, unique_keys: bool = False) -> Iterator[tuple[int, Any, str | None]]:
    """``(line number, value, None)`` for each non-blank line, or ``(line number, None, why)`` when it is not
    JSON shardcache reads (malformed, nested too deep, or with ``unique_keys`` an object naming a key twice); line
    numbers count from 1, blank lines included."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, parse_json(line, unique_keys=unique_keys), None
        except JSONError as exc:
            yield number, None, exc.msg
