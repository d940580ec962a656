"""The run mode's one spelling (``RunMode.parse``): text, the JSON form and a bare count, read into a mode.

Why one place: the mode was spelled four ways (a value in Python, three CLI strings, a bare ``workers`` integer in
the run record and the forecast), each with its own reading of a count or a name. Text:
``KIND[:WORKERS][,NAME=VALUE...]`` (``"threads:8,decoders=2"``, ``"auto"``, ``"auto:4"``); a bare count ``N``
(text or integer) is ``processes:N``, 0 ``in-process``, as DataLoader's ``num_workers`` and ``--workers`` mean it.
JSON: ``{"kind": KIND, FIELD: VALUE, ...}``, the mode's own fields (``RunMode.to_json``). A mode that needs
workers and is given none gets ``default_num_workers()``.

The modes are not imported here: ``parse_mode`` is given the kinds (``RunMode.KINDS``, which each mode class joins
when it is defined), so this module sits below the modes and the loader base reaches it without an import loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from shards.errors import InputError
from shards.jobs.parallel import MAX_DEFAULT_WORKERS, usable_cpus

COUNTED = "processes"  # the kind a bare count N >= 1 names (DataLoader's num_workers=N)
NONE = "in-process"  # the kind a count of 0 names


def default_num_workers() -> int:
    """One worker per CPU this process may use, leaving one for the training loop, capped at 8."""
    return max(1, min(MAX_DEFAULT_WORKERS, usable_cpus() - 1))


def parse_mode(value: Any, kinds: Mapping[str, type]) -> Any:
    """The mode ``value`` spells (the docstring above) among ``kinds`` (kind name -> mode class); a mode instance
    is returned as it is. An ``InputError`` naming what is wrong and the spelling otherwise."""
    if any(isinstance(value, mode) for mode in kinds.values()):
        return value
    if isinstance(value, bool):
        raise InputError(f"run mode {value!r} is not a run mode: {_spelling(kinds)}")
    if isinstance(value, int):
        return _of_count(value, kinds)
    if isinstance(value, str):
        return _of_text(value, kinds)
    if isinstance(value, Mapping):
        return _of_json(value, kinds)
    raise InputError(f"run mode {value!r} is not a run mode: {_spelling(kinds)}")


def _spelling(kinds: Mapping[str, type]) -> str:
    return "give KIND[:WORKERS][,NAME=VALUE...] with KIND one of " + ", ".join(kinds) + ", or a worker count"


def _of_count(count: int, kinds: Mapping[str, type]) -> Any:
    if count < 0:
        raise InputError(f"a worker count must be >= 0, got {count} (0: in the training process)")
    return kinds[NONE]() if count == 0 else kinds[COUNTED](count)


def _of_text(text: str, kinds: Mapping[str, type]) -> Any:
    head, *options = [part.strip() for part in text.strip().split(",")]
    if head.isdigit():
        if options:
            raise InputError(f"run mode {text!r}: options need a kind ({head} is {COUNTED}:{head})")
        return _of_count(int(head), kinds)
    kind, _, count = head.partition(":")
    record: dict[str, Any] = {"kind": kind}
    if count:
        if not count.isdigit():
            raise InputError(f"run mode {text!r}: {count!r} is not a worker count; {_spelling(kinds)}")
        record["workers"] = int(count)
    for option in options:
        name, equals, number = option.partition("=")
        if not equals:
            raise InputError(f"run mode {text!r}: {option!r} is not NAME=VALUE; {_spelling(kinds)}")
        record[name.strip()] = _value(text, number.strip())
    return _of_json(record, kinds, repr(text))


def _value(text: str, value: str) -> Any:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if value.isdigit():
        return int(value)
    raise InputError(f"run mode {text!r}: {value!r} is neither a whole number nor true/false")


def _of_json(record: Mapping[str, Any], kinds: Mapping[str, type], spelled: str | None = None) -> Any:
    kind = record.get("kind")
    mode = kinds.get(kind) if isinstance(kind, str) else None
    if mode is None:
        raise InputError(f"run mode {spelled or repr(dict(record))}: kind {kind!r} is not one of {', '.join(kinds)}")
    known = {item.name for item in dataclasses.fields(mode)}
    options = {name: value for name, value in record.items() if name != "kind"}
    unknown = sorted(set(options) - known)
    if unknown:
        renamed = getattr(mode, "RENAMED", {}).get(unknown[0])
        hint = renamed or (f"it takes {', '.join(sorted(known))}" if known else "it takes no options")
        raise InputError(f"run mode {kind!r} has no option {unknown[0]!r}: {hint}")
    if "workers" in known and "workers" not in options:
        options["workers"] = default_num_workers()
    return mode(**options)
