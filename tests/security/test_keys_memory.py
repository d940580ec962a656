"""``--keys FILE`` / ``--exclude-keys FILE``: a key list costs memory in proportion to the keys it keeps.

The list is parsed a block at a time into sorted arrays of UTF-8 bytes, never as the whole text plus a list of
``str`` plus a set of them (about 7x the file's bytes at the peak, and 5x kept): a list of 10 million keys is a
few hundred MB, not several GB, on every rank.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from shards.errors import InputError
from shards.select.key_set import read_keys
from shards.select.mixture import Subset

KEYS = 200_000
# The stated bounds, in multiples of the file's bytes: what the kept keys hold after reading (their bytes padded to
# a multiple of 8, no object per key), and the peak while reading (the kept arrays, their merge, one block).
KEPT_BOUND = 1.6
PEAK_BOUND = 3.0


def write_keys(path: Path, count: int = KEYS) -> Path:
    """Keys as pack-shards makes them (``train_<index>_<hash>``, 24 characters) in no particular order."""
    order = np.random.default_rng(0).permutation(count)
    path.write_text("".join(f"train_{i:08d}_{i * 2654435761 % 16**8:08x}\n" for i in order), encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_key_list_costs_memory_in_proportion_to_its_keys(tmp_path: Path):
    path = write_keys(tmp_path / "keys.txt")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        keys = read_keys(path)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(keys) == KEYS
    assert kept <= KEPT_BOUND * size, f"{kept / size:.1f}x the file kept"
    assert peak <= PEAK_BOUND * size, f"{peak / size:.1f}x the file at the peak"


def test_the_keys_read_are_the_lines_of_the_file(tmp_path: Path):
    """One key per line: a byte order mark, blank lines, surrounding spaces and Windows or old Mac line ends are
    not part of any key; a key listed twice counts once."""
    path = tmp_path / "keys.txt"
    path.write_bytes("\ufeffa-1\r\n  b-2 \n\n\tc-3\rd-4\na-1\nlonger-key-than-the-others-\u00e9\n".encode("utf-8"))
    keys = read_keys(path)
    assert len(keys) == 5
    for key in ("a-1", "b-2", "c-3", "d-4", "longer-key-than-the-others-\u00e9"):
        assert key in keys
    for key in ("a", "a-", "b-2 ", "", "e-5", "\ufeffa-1"):
        assert key not in keys
    assert sorted(keys) == ["a-1", "b-2", "c-3", "d-4", "longer-key-than-the-others-\u00e9"]


def test_keys_given_from_python_read_as_a_file_does(tmp_path: Path):
    keys = Subset(keys=["x", "y", "x"]).key_set()
    assert len(keys) == 2 and "x" in keys and "z" not in keys


def test_a_key_list_that_is_not_utf8_names_the_byte(tmp_path: Path):
    path = tmp_path / "keys.txt"
    path.write_bytes(b"a-1\n" * 300_000 + b"b-\xff\n")  # past the first block: the offset is the file's
    with pytest.raises(InputError, match=r"not UTF-8 text \(invalid start byte at byte 1200002\)"):
        read_keys(path)


def test_keys_match_a_column_of_any_width(tmp_path: Path):
    """The fixed-width key column of a column index: keys longer than its width cannot be in it."""
    path = tmp_path / "keys.txt"
    path.write_text("ab\nabcdef\nabcdefghijklmnopq\nzz\n", encoding="utf-8")
    keys = read_keys(path)
    column = np.asarray([b"ab", b"abc", b"abcdef", b"zz", b"q"], dtype="S6")
    assert keys.member(column).tolist() == [True, False, True, True, False]
