"""Names and values checked by a pattern end where the text ends: ``$`` also matches before a trailing newline, so
``^[A-Za-z0-9_]+$`` took the split ``"val\\n"`` and a shard file with a newline in its name was written (and a
sha256 key, a bucket or a shard name could carry one the same way). Every anchored pattern ends in ``\\Z``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from preprocess.pack.sources.csv_records import SPLIT_NAME
from preprocess.pack.sources.tars import KEY
from shards.cache.node_locks import SHA256_PATTERN
from shards.formats.feature_names import is_feature_file
from shards.units import parse_size

ROOT = Path(__file__).resolve().parents[2]
ANCHORED_AT_DOLLAR = re.compile(r"""r?(["'])[^"'\n]*\$\1\)?""")  # a pattern literal that ends in $


def test_no_pattern_in_the_code_ends_in_a_dollar():
    found = []
    for package in ("shards", "preprocess", "train"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "re." in line or "compile" in line or line.lstrip().startswith('r"'):
                    if ANCHORED_AT_DOLLAR.search(line.split("#")[0]) and not line.lstrip().startswith(("f\"", "#")):
                        found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []


@pytest.mark.parametrize("pattern,good", [(SPLIT_NAME, "val"), (KEY, "a/b_c"), (SHA256_PATTERN, "0" * 64)])
def test_a_trailing_newline_is_not_part_of_a_name(pattern, good):
    assert pattern.match(good) and not pattern.match(good + "\n")


def test_values_with_a_trailing_newline_are_refused():
    assert is_feature_file("train-000000.pt") and not is_feature_file("train-000000.pt\n")
    assert parse_size("4M") == 4 * 1024**2
    with pytest.raises(Exception):
        parse_size("4M\nx")
