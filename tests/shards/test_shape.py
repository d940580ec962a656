"""The door's shape checks and parser guard: what a reader may rely on after asking for a field."""

from __future__ import annotations

import math

import pytest

from shards.door.bounded_read import JSONError, parse_json, parser_guard
from shards.errors import CorruptDataError, InputError, ManifestError
from shards.door.shape import MAX_COUNT, as_bool, as_int, as_int_list, as_list, as_number, as_object, as_str, field


@pytest.mark.parametrize("value", ["7", 2.5, 2.0, True, False, None, math.nan, math.inf, 1e30, [], {}])
def test_an_int_is_a_json_integer_and_nothing_else(value):
    with pytest.raises(ManifestError, match=r"d/dataset\.json: splits\.train\.samples is .*expected an integer"):
        as_int(value, "splits.train.samples", where="d/dataset.json")


def test_an_int_is_inside_its_range():
    assert as_int(7, "n") == 7
    with pytest.raises(ManifestError, match="from 1 to 10"):
        as_int(0, "n", lo=1, hi=10)
    with pytest.raises(ManifestError, match="9,007,199,254,740,992"):
        as_int(MAX_COUNT + 1, "n")


@pytest.mark.parametrize("value", [math.nan, -math.inf, True, "1.5", None])
def test_a_number_is_finite(value):
    with pytest.raises(InputError, match="expected a finite number"):
        as_number(value, "lr", error=InputError)


def test_other_shapes_name_the_field_and_the_caller_chooses_the_error():
    assert as_object({"a": 1}, "x") == {"a": 1}
    assert as_list([1], "x") == [1]
    assert as_str("a", "x") == "a"
    assert as_bool(False, "x") is False
    with pytest.raises(InputError, match="state.epoch is"):
        as_object([], "state.epoch", error=InputError)
    with pytest.raises(ManifestError, match="at most 2 are allowed"):
        as_list([1, 2, 3], "x", max_len=2)
    with pytest.raises(ManifestError, match="characters: at most 3"):
        as_str("abcd", "x", max_len=3)
    with pytest.raises(ManifestError, match="expected true or false"):
        as_bool(1, "x")


def test_int_lists_are_checked_whole():
    assert as_int_list([0, 3, 5], "counts") == [0, 3, 5]
    for bad in ([1, 2.0], [1, True], [1, -1], [1, "2"]):
        with pytest.raises(ManifestError, match="an item of counts"):
            as_int_list(bad, "counts")


def test_field_tells_missing_from_null():
    assert field({"a": None}, "a", "x", default=3) == 3
    assert field({"a": None}, "a", "x") is None
    with pytest.raises(ManifestError, match="x.b is missing"):
        field({"a": 1}, "b", "x")


def test_a_number_too_long_for_int_is_a_json_error():
    with pytest.raises(JSONError, match="not valid JSON"):
        parse_json("1" * 5000)


@pytest.mark.parametrize("exc", [MemoryError("x"), RecursionError(), OverflowError("big"), ValueError("bad\nmore"),
                                 KeyError("k")])
def test_the_guard_turns_parser_failures_into_one_line(exc):
    with pytest.raises(CorruptDataError) as info:
        with parser_guard("d/x.parquet", "cannot read Parquet metadata"):
            raise exc
    assert str(info.value).startswith("d/x.parquet: cannot read Parquet metadata (")
    assert "\n" not in str(info.value)


def test_the_guard_lets_shape_errors_through_and_knows_parser_types():
    class ParserOwn(Exception):
        pass

    with pytest.raises(ManifestError, match="n is"):
        with parser_guard("f", "reading"):
            as_int("1", "n")
    with pytest.raises(InputError, match="f: reading .ParserOwn: odd"):
        with parser_guard("f", "reading", error=InputError, catch=(ParserOwn,)):
            raise ParserOwn("odd")
