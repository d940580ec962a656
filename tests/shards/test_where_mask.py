"""``Where.mask`` over columns is the row-wise filter, row for row: the same selections and the same errors."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shards.errors import InputError
from shards.select.where import ArrayColumns, Where, member_bytes

STRINGS = ["", "a", "ab", "b", "RGB", "L", "é", "zé", "a b"]
NUMBERS = [-3, -1, 0, 1, 2, 3, -1.5, 0.0, 0.5, 1.0, 2.5, True, False]


def _columns(rng: random.Random, rows: int) -> tuple[ArrayColumns, list[dict]]:
    """Random columns (every kind, two with presence masks) and the same samples as row-wise fields."""
    keys = [f"k{i}" for i in range(rows)]
    labels = [rng.randrange(3) for _ in range(rows)]
    classes = ["cat", "dog", "émeu"]
    values = {
        "width": [rng.randint(-3, 3) for _ in range(rows)],
        "height": [rng.randint(-3, 3) for _ in range(rows)],
        "ratio": [rng.choice([-1.5, 0.0, 0.5, 1.0, 2.5]) for _ in range(rows)],
        "flag": [rng.random() < 0.5 for _ in range(rows)],
        "mode": [rng.choice(STRINGS) for _ in range(rows)],
        "path": [rng.choice(STRINGS) for _ in range(rows)],
    }
    present = {"height": np.asarray([rng.random() < 0.8 for _ in range(rows)]),
               "mode": np.asarray([rng.random() < 0.9 for _ in range(rows)])}
    arrays = {"key": np.asarray([k.encode() for k in keys], dtype="S8"),
              "label": np.asarray(labels, dtype=np.int32),
              "class": np.asarray([classes[n].encode() for n in labels]),
              "width": np.asarray(values["width"], dtype=np.int64),
              "height": np.asarray(values["height"], dtype=np.int64),
              "ratio": np.asarray(values["ratio"], dtype=np.float64),
              "flag": np.asarray(values["flag"], dtype=bool),
              "mode": np.asarray([v.encode() for v in values["mode"]], dtype="S8"),
              "path": np.asarray([v.encode() for v in values["path"]], dtype="S8")}
    rows_fields = []
    for i in range(rows):
        meta = {name: column[i] for name, column in values.items() if name not in present or present[name][i]}
        rows_fields.append({**meta, "key": keys[i], "label": labels[i], "class": classes[labels[i]]})
    return ArrayColumns(arrays, present), rows_fields


def random_literal(rng: random.Random) -> str:
    choice = rng.random()
    if choice < 0.45:
        return repr(rng.choice(NUMBERS))
    if choice < 0.85:
        return repr(rng.choice(STRINGS + ["cat", "émeu"]))
    if choice < 0.9:
        return "None"
    return repr(tuple(rng.sample(NUMBERS + STRINGS, rng.randint(0, 4))))


FIELDS = ("width", "height", "ratio", "flag", "mode", "path", "class", "label", "key", "nope")


def random_atom(rng: random.Random, names: tuple[str, ...] = FIELDS) -> str:
    if rng.random() < 0.6:
        return rng.choice(names)
    return random_literal(rng)


def random_expression(rng: random.Random, depth: int = 0, names: tuple[str, ...] = FIELDS) -> str:
    """A random filter over ``names`` (fields, some perhaps absent) and literals of every kind."""
    choice = rng.random()
    if depth > 2 or choice < 0.5:
        ops = ["==", "!=", "<", "<=", ">", ">=", "in", "not in"]
        parts = [random_atom(rng, names)]
        for _ in range(rng.choice([1, 1, 1, 2])):
            parts += [rng.choice(ops), random_atom(rng, names)]
        return " ".join(parts)
    if choice < 0.6:
        return f"not ({random_expression(rng, depth + 1, names)})"
    if choice < 0.65:
        return random_atom(rng, names)
    joiner = rng.choice([" and ", " or "])
    return joiner.join(f"({random_expression(rng, depth + 1, names)})" for _ in range(rng.randint(2, 3)))


def _row_wise(where: Where, rows: list[dict], live: np.ndarray) -> np.ndarray | str:
    """What the row-wise filter gives: the selection, or the message of the error it stops at."""
    out = np.zeros(len(rows), dtype=bool)
    for i, fields in enumerate(rows):
        if live[i]:
            try:
                out[i] = where(fields)
            except InputError as exc:
                return str(exc)
    return out


def _vectorised(where: Where, columns: ArrayColumns, live: np.ndarray) -> np.ndarray | str:
    try:
        return where.mask(columns, live)
    except InputError as exc:
        return str(exc)


def test_random_filters_select_and_fail_exactly_as_row_by_row():
    rng = random.Random(22)
    compared = errors = 0
    for trial in range(600):
        columns, rows = _columns(rng, rng.randint(1, 40))
        live = np.asarray([rng.random() < 0.7 for _ in rows])
        expression = random_expression(rng)
        try:
            where = Where(expression)
        except InputError:
            continue
        expected, got = _row_wise(where, rows, live), _vectorised(where, columns, live)
        if isinstance(expected, str):
            errors += 1
            assert got == expected, expression
        else:
            assert isinstance(got, np.ndarray), (expression, got)
            assert got.tolist() == expected.tolist(), expression
        compared += 1
    assert compared > 400 and 50 < errors < compared - 100  # both outcomes well exercised


@pytest.mark.parametrize("expression", [
    "width >= 2 and mode == 'RGB'", "mode > 'L' or not flag", "-1 < width <= 2", "mode in ('RGB', 'L')",
    "class not in ['cat']", "flag == 1", "ratio != 0.5", "'b' in mode", "mode in 'RGBA'", "mode in path",
    "width == 'a'", "key in ('k1', 'k3')", "label >= 1",
])
def test_named_cases_agree(expression):
    columns, rows = _columns(random.Random(expression), 60)
    live = np.ones(len(rows), dtype=bool)
    where = Where(expression)
    expected = _row_wise(where, rows, live)
    got = _vectorised(where, columns, live)
    assert (got == expected) if isinstance(expected, str) else got.tolist() == expected.tolist()


def test_the_right_side_is_looked_at_only_where_it_matters():
    columns = ArrayColumns({"key": np.asarray([b"a", b"b", b"c"]), "width": np.asarray([1, 5, 1]),
                            "mode": np.asarray([b"", b"RGB", b""])},
                           present={"mode": np.asarray([False, True, False])})
    # rows a and c lack mode, but "and" never looks at it there
    assert Where("width > 2 and mode == 'RGB'").mask(columns).tolist() == [False, True, False]
    assert Where("width < 2 or mode < 3").mask(columns, np.asarray([True, False, True])).tolist() == [True, False, True]
    with pytest.raises(InputError, match=r"cannot compare 'RGB' with 3 \[sample b\]"):
        Where("width < 2 or mode < 3").mask(columns)
    with pytest.raises(InputError, match=r"sample 'a' has no field 'mode' \(it has key, width\)"):
        Where("mode == 'RGB'").mask(columns)
    with pytest.raises(InputError, match=r"sample 'b' has no field 'nope'"):
        Where("nope == 1").mask(columns, np.asarray([False, True, True]))
    assert Where("nope == 1").mask(columns, np.zeros(3, dtype=bool)).tolist() == [False] * 3


def test_strings_compare_in_code_point_order():
    text = ["a", "z", "é", "ü", "中", "𝄞", "Z", ""]
    columns = ArrayColumns({"key": np.asarray([t.encode() or b"-" for t in text]),
                            "name": np.asarray([t.encode() for t in text])})
    for literal in text:
        for op in ("<", "<=", ">", ">="):
            where = Where(f"name {op} {literal!r}")
            assert where.mask(columns).tolist() == [where({"name": t, "key": t}) for t in text]


def test_member_bytes_matches_a_key_set_without_copying_the_column():
    column = np.asarray([f"key-{i:05d}".encode() for i in range(1000)])
    wanted = {b"key-00003", b"key-00999", b"absent", b"a-key-longer-than-the-column"}
    found = member_bytes(column, wanted, chunk=7)
    assert np.flatnonzero(found).tolist() == [3, 999]
    assert not member_bytes(column, []).any()


def test_fields_names_what_the_filter_reads():
    assert Where("class == 'cat' and (width > 3 or mode in ('L',))").fields == {"class", "width", "mode"}
