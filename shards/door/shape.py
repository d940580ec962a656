"""The shape of untrusted JSON: a parsed value checked field by field before any code relies on it.

``parse_json`` (``shards.door.bounded_read``) only says the text is JSON. A manifest, saved state, cache plan or run
record that *is* JSON can still hold ``"7"``, ``2.5``, ``true``, ``NaN`` or ``1e30`` where a count belongs, a list
where an object belongs, or a count of ``10**18`` that a loop or an allocation would trust. ``int("7")``,
``int(2.5)`` and ``int(True)`` all succeed silently, so readers never convert: they ask this module for a field of
a stated type and range and get either that or one error naming the file and the field
(``dataset.json: splits.train.samples is 2.5: expected an integer``).

The rules, the same for every reader (docs/trust-model.md, "One door"):
- an integer is a JSON integer (``type(v) is int``: no bool, no float, no string), inside ``[lo, hi]``;
- a number is an int or a finite float (no bool, no NaN or infinity), inside ``[lo, hi]`` when given;
- a string is a ``str`` of at most ``max_len`` characters; an object a ``dict``; a list a ``list`` of at most
  ``max_len`` items.

The error type is the caller's (``ManifestError`` for manifests, ``InputError`` for saved states), and the message
is the caller's ``what`` (a dotted field path), so one function serves every reader without knowing any of them.
"""

from __future__ import annotations

import math
import reprlib
from typing import Any, Mapping

from shards.errors import InputError, ManifestError

# The largest count any field may hold unless the caller says less: 2**53 keeps every count exact in a float and
# in JSON readers of other languages, and is far beyond any real sample, byte or step count.
MAX_COUNT = 1 << 53
MISSING: Any = object()


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 30, 30


def _show(value: Any) -> str:
    """A short picture of a refused value: bounded in depth and items, so a refused 10-million-item list or a
    value nested thousands deep costs microseconds, not a recursive repr of all of it."""
    text = _REPR.repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fail(what: str, value: Any, expected: str, where: str | None, error: type[InputError]) -> InputError:
    return error(f"{what} is {_show(value)}: expected {expected}", path=where)


def as_object(value: Any, what: str, *, where: str | None = None,
              error: type[InputError] = ManifestError) -> dict[str, Any]:
    """``value`` if it is a JSON object; else ``error`` naming ``what``."""
    if type(value) is not dict:
        raise _fail(what, value, "an object", where, error)
    return value


def as_list(value: Any, what: str, *, max_len: int = MAX_COUNT, where: str | None = None,
            error: type[InputError] = ManifestError) -> list[Any]:
    """``value`` if it is a JSON array of at most ``max_len`` items."""
    if type(value) is not list:
        raise _fail(what, value, "a list", where, error)
    if len(value) > max_len:
        raise error(f"{what} has {len(value):,} items: at most {max_len:,} are allowed", path=where)
    return value


def as_int(value: Any, what: str, *, lo: int = 0, hi: int = MAX_COUNT, where: str | None = None,
           error: type[InputError] = ManifestError) -> int:
    """``value`` if it is a JSON integer in ``[lo, hi]``; bools, floats (``2.0`` too) and strings are refused."""
    if type(value) is not int:
        raise _fail(what, value, "an integer", where, error)
    if not lo <= value <= hi:
        raise _fail(what, value, f"an integer from {lo:,} to {hi:,}", where, error)
    return value


def as_number(value: Any, what: str, *, lo: float = -math.inf, hi: float = math.inf, where: str | None = None,
              error: type[InputError] = ManifestError) -> float:
    """``value`` as a float if it is a finite JSON number in ``[lo, hi]``; bools, NaN and infinities refused."""
    if type(value) not in (int, float) or not math.isfinite(value):
        raise _fail(what, value, "a finite number", where, error)
    if not lo <= value <= hi:
        raise _fail(what, value, f"a number from {lo:g} to {hi:g}", where, error)
    return float(value)


def as_str(value: Any, what: str, *, max_len: int = 4096, where: str | None = None,
           error: type[InputError] = ManifestError) -> str:
    """``value`` if it is a string of at most ``max_len`` characters."""
    if type(value) is not str:
        raise _fail(what, value, "a string", where, error)
    if len(value) > max_len:
        raise error(f"{what} is a string of {len(value):,} characters: at most {max_len:,} are allowed",
                    path=where)
    return value


def as_bool(value: Any, what: str, *, where: str | None = None, error: type[InputError] = ManifestError) -> bool:
    """``value`` if it is ``true`` or ``false``."""
    if type(value) is not bool:
        raise _fail(what, value, "true or false", where, error)
    return value


def as_int_list(value: Any, what: str, *, lo: int = 0, hi: int | None = MAX_COUNT, max_len: int = MAX_COUNT,
                where: str | None = None, error: type[InputError] = ManifestError) -> list[int]:
    """``value`` if it is a list of JSON integers in ``[lo, hi]``; checked with set and min/max (in C), since a
    manifest may hold millions of them. ``hi=None`` skips the pass for the upper bound, for a caller that bounds
    the items otherwise (class counts must sum to a bounded sample count)."""
    items = as_list(value, what, max_len=max_len, where=where, error=error)
    if items and (not set(map(type, items)) <= {int} or min(items) < lo or (hi is not None and max(items) > hi)):
        top = MAX_COUNT if hi is None else hi
        bad = next(v for v in items if type(v) is not int or v < lo or (hi is not None and v > hi))
        raise _fail(f"an item of {what}", bad, f"an integer from {lo:,} to {top:,}", where, error)
    return items


def field(data: Mapping[str, Any], name: str, what: str, *, default: Any = MISSING, where: str | None = None,
          error: type[InputError] = ManifestError) -> Any:
    """``data[name]``; ``default`` when absent (``null`` counts as absent only when a default is given), else an
    error naming ``what.name`` as missing."""
    value = data.get(name, MISSING)
    if value is MISSING or (value is None and default is not MISSING):
        if default is MISSING:
            raise error(f"{what}.{name} is missing" if what else f"{name} is missing", path=where)
        return default
    return value
