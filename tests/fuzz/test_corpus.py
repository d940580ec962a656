"""Every input a fuzz run found (``tests/fuzz/corpus/<target>/``) stays a regression case: it reads, or raises a
``ShardcacheError``, within the bounds. And every target is fuzzed by one of the tests here."""

import pytest

from tests.fuzz.engine import TARGETS, corpus_cases, run_input

pytestmark = [pytest.mark.fuzz, pytest.mark.slow]


@pytest.mark.parametrize("target, path", corpus_cases(), ids=lambda value: getattr(value, "name", value))
def test_a_saved_case_reads_or_raises_a_shardcache_error(target, path, seeds):
    assert target in TARGETS, f"{path}: no fuzz target {target!r} (renamed? move the case)"
    spec = TARGETS[target]
    for artifact in spec.needs:
        seeds.path(artifact)
    spec.seed(seeds)
    outcome = run_input(spec, path.read_bytes(), seeds)
    if outcome.failed:
        pytest.fail(f"{target}/{path.name}: {outcome.describe()}", pytrace=False)


def test_every_target_is_fuzzed():
    from pathlib import Path

    tests = "".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py") if p.name != "test_corpus.py")
    assert [name for name in TARGETS if f'"{name}"' not in tests] == []
