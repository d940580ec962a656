"""The quick loop's half-second rule (tests/quick_limit.py): which sessions it applies to, where its limit comes
from, and that a session with a test over it exits non-zero naming the test, its time and the fix."""

from __future__ import annotations

import pytest

from tests.quick_limit import DEFAULT_LIMIT_S, LIMIT_ENV, is_quick_loop, limit_from, over_limit

pytest_plugins = ["pytester"]

INNER_CONFTEST = """
from tests.quick_limit import QuickLimit, add_option

def pytest_addoption(parser):
    add_option(parser)

def pytest_configure(config):
    QuickLimit.configure(config)
"""
INNER_TESTS = """
import time

def test_quick():
    pass

def test_sleepy():
    time.sleep(0.08)
"""


@pytest.mark.parametrize("markexpr, quick", [("not slow", True), ("not slow and not s3", True),
                                             ("(not  slow) and unit", True), ("slow", False), ("", False),
                                             (None, False), ("not slowish", False), ("not s3", False)])
def test_the_quick_loop_is_an_expression_leaving_out_slow(markexpr, quick):
    assert is_quick_loop(markexpr) is quick


def test_the_limit_is_the_option_else_the_environment_else_half_a_second():
    assert limit_from(None, {}) == DEFAULT_LIMIT_S == 0.5
    assert limit_from(None, {LIMIT_ENV: "2"}) == 2.0
    assert limit_from("1.5", {LIMIT_ENV: "2"}) == 1.5
    assert limit_from(None, {LIMIT_ENV: ""}) == 0.5
    with pytest.raises(pytest.UsageError, match=LIMIT_ENV):
        limit_from(None, {LIMIT_ENV: "fast"})
    with pytest.raises(pytest.UsageError, match="--quick-limit"):
        limit_from("-1", {})


def test_one_line_per_test_over_the_limit_slowest_first_and_none_when_off():
    seconds = {"t.py::a": 0.2, "t.py::b": 0.75, "t.py::c": 1.25, "t.py::d": 0.5}
    lines = over_limit(seconds, 0.5)
    assert len(lines) == 2
    assert lines[0].startswith("t.py::c took 1.25 s") and lines[1].startswith("t.py::b took 0.75 s")
    assert all("@pytest.mark.slow" in line and "limit 0.5 s" in line for line in lines)
    assert over_limit(seconds, 0) == []


def _inner(pytester: pytest.Pytester, *args: str, cache: bool = False) -> pytest.RunResult:
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS)
    return pytester.runpytest_inprocess("-p", "no:randomly", *(() if cache else ("-p", "no:cacheprovider")), *args)


def test_a_quick_session_with_a_test_over_the_limit_fails_naming_it(pytester: pytest.Pytester, monkeypatch):
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = _inner(pytester, "-m", "not slow", "--quick-limit", "0.04")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*quick tests over the limit*",
                                 "test_inner.py::test_sleepy took 0.* s in the quick loop (limit 0.04 s): mark it "
                                 "@pytest.mark.slow or make it cheaper"])
    assert "test_quick took" not in result.stdout.str()


def test_a_raised_limit_passes(pytester: pytest.Pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv(LIMIT_ENV, "5")
    assert _inner(pytester, "-m", "not slow").ret == pytest.ExitCode.OK


def test_a_full_run_has_no_limit(pytester: pytest.Pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv(LIMIT_ENV, "0.04")
    assert _inner(pytester).ret == pytest.ExitCode.OK  # no -m "not slow": the full suite has no such rule


@pytest.mark.slow  # over half a second in the quick loop
def test_with_the_cache_a_test_fails_only_when_over_the_limit_twice_in_a_row(pytester: pytest.Pytester, monkeypatch):
    monkeypatch.delenv(LIMIT_ENV, raising=False)
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    first = _inner(pytester, "-m", "not slow", "--quick-limit", "0.04", cache=True)
    assert first.ret == pytest.ExitCode.OK  # once may be a loaded machine's noise
    first.stdout.fnmatch_lines(["*quick tests over the limit once*", "test_inner.py::test_sleepy took 0.* s*over once*"])
    second = _inner(pytester, "-m", "not slow", "--quick-limit", "0.04", cache=True)
    assert second.ret == pytest.ExitCode.TESTS_FAILED
    second.stdout.fnmatch_lines(["*= quick tests over the limit =*", "test_inner.py::test_sleepy took 0.* s*"])
    third = _inner(pytester, "-m", "not slow", "--quick-limit", "5", cache=True)
    assert third.ret == pytest.ExitCode.OK  # under the limit: the name leaves the cache
    fourth = _inner(pytester, "-m", "not slow", "--quick-limit", "0.04", cache=True)
    assert fourth.ret == pytest.ExitCode.OK
