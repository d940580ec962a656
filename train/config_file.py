"""The shape of a recorded run config (``config.json``): checked group by group and field by field before any
option group is made from it.

A resume reads ``config.json`` from a folder it does not trust. Every group and field must be one the option groups
(``train.options``) declare, holding a value of the declared type (``"7"``, ``2.5`` or ``true`` for epochs, ``NaN``
for a rate are refused, not converted): a field that is not known is refused by its dotted path rather than dropped,
since a dropped field would let a different run pass as this one. Ranges and how fields combine stay the groups'
own checks (``__post_init__``), so each rule has one definition.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from shards.door.shape import MAX_COUNT, as_bool, as_int, as_list, as_number, as_object, as_str, field as get
from shards.errors import ManifestError


def _signed(value: Any, what: str, *, where: str | None) -> int:
    return as_int(value, what, lo=-MAX_COUNT, where=where)  # ranges are the groups' to check (a seed may be < 0)


# The shape of each annotation the option groups use, by its type's name; ``X | None`` is X or null.
_FIELD_SHAPES: dict[str, Callable[..., Any]] = {"int": _signed, "float": as_number, "bool": as_bool, "str": as_str,
                                                 "dict": as_object, "list": as_list}

# A mixture's parts as config.json records them (train.api.data_sources, --classes/--keys/--where/--max-samples).
SOURCE_FIELDS = ("path", "weight", "repeat", "choose")
SUBSET_FIELDS = ("classes", "keys", "where", "max_samples")


def read_groups(data: Any, kinds: Mapping[str, type], where: str) -> dict[str, Any]:
    """The option groups ``kinds`` (attribute name -> group class) made from a recorded config ``data``, after its
    shape is checked; a bad shape is one ``ManifestError`` naming ``where`` and the field's dotted path."""
    data = as_object(data, "the run config", where=where)
    _refuse_unknown(data, tuple(kinds), "the run config", "group", where)
    records = {name: _group_fields(kind, as_object(get(data, name, "", where=where), name, where=where), name, where)
               for name, kind in kinds.items()}
    _check_mixture(records.get("data", {}), where)
    return {name: kind(**records[name]) for name, kind in kinds.items()}


def _group_fields(kind: type, record: dict[str, Any], group: str, where: str) -> dict[str, Any]:
    fields = dataclasses.fields(kind)
    _refuse_unknown(record, tuple(f.name for f in fields), group, "field", where)
    values = {}
    for item in fields:
        type_name, _, optional = str(item.type).partition(" | ")
        required = item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
        if item.name not in record and not required:
            continue
        path = f"{group}.{item.name}"
        value = get(record, item.name, group, where=where)
        if value is not None or not optional:
            _FIELD_SHAPES[type_name](value, path, where=where)
        values[item.name] = value
    return values


def _refuse_unknown(record: Mapping[str, Any], known: tuple[str, ...], what: str, kind: str, where: str) -> None:
    unknown = sorted(set(record) - set(known))
    if unknown:
        name = unknown[0] if what == "the run config" else f"{what}.{unknown[0]}"
        raise ManifestError(f"{name} is not a {kind} of {what} (it has {', '.join(known)})", path=where)


def _record(value: Any, what: str, fields: tuple[str, ...], where: str) -> dict[str, Any]:
    """A recorded source or subset: an object of ``fields`` only (a null one is absent)."""
    record = as_object(value, what, where=where)
    unknown = sorted(set(record) - set(fields))
    if unknown:
        raise ManifestError(f"{what} has unknown field {unknown[0]!r} (it records {', '.join(fields)})", path=where)
    return {name: item for name, item in record.items() if item is not None}


def _check_mixture(data: Mapping[str, Any], where: str) -> None:
    """The recorded ``data.sources`` and ``data.subset``, field by field: what ``SourceSpec`` and ``Subset`` are
    then made from (they check how the fields combine)."""
    for index, value in enumerate(data.get("sources") or ()):
        what = f"data.sources[{index}]"
        source = _record(value, what, SOURCE_FIELDS, where)
        as_str(get(source, "path", what, where=where), f"{what}.path", where=where)
        for name in ("weight", "repeat"):
            if name in source and not as_number(source[name], f"{what}.{name}", where=where) > 0:
                raise ManifestError(f"{what}.{name} is {source[name]!r}: expected a number above 0", path=where)
        if "choose" in source:
            as_int(source["choose"], f"{what}.choose", lo=1, where=where)
    if data.get("subset") is None:
        return
    subset = _record(data["subset"], "data.subset", SUBSET_FIELDS, where)
    for index, name in enumerate(as_list(subset.get("classes", []), "data.subset.classes", where=where)):
        as_str(name, f"data.subset.classes[{index}]", where=where)
    for name in ("keys", "where"):
        if name in subset:
            as_str(subset[name], f"data.subset.{name}", where=where)
    if "max_samples" in subset:
        as_int(subset["max_samples"], "data.subset.max_samples", lo=1, where=where)
