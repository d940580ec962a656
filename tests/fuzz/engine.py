"""The fuzz loop: Hypothesis draws mutations of a target's seed, each runs in a bounded child (``sandbox``), and a
failing input is kept (``tests/fuzz/corpus/<target>/<sha>.<suffix>``) when ``scripts/fuzz`` asks for it.

Two Hypothesis profiles (``SHARDCACHE_FUZZ_PROFILE``, loaded by ``tests/fuzz/conftest.py``):

- ``ci`` (the default, what ``scripts/test`` and ``.ci/run`` use): derandomized, so every run tries the same inputs;
  each target's ``examples`` sized so that the whole suite takes about 2 minutes on a 2-core machine; no shrinking.
- ``long`` (``scripts/fuzz``): random, each target fuzzed in rounds until its share of the time
  (``SHARDCACHE_FUZZ_SECONDS``) is spent; every distinct failure is shrunk, kept, and the target goes on.

No Hypothesis deadline: wall time on a shared machine varies with the load. The bound is the reader's CPU time
(``CPU_LIMIT_S``), measured in the child, plus a hard kill for a hang (``sandbox.HANG_S``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.fuzz import targets, targets_adopt, targets_state  # noqa: F401 - they register the targets
from tests.fuzz.registry import TARGETS, Target
from tests.fuzz.sandbox import Outcome, run_bounded
from tests.fuzz.seeds import Seeds

PROFILE_ENV = "SHARDCACHE_FUZZ_PROFILE"
SAVE_ENV = "SHARDCACHE_FUZZ_SAVE"  # "1": write each failing input to the corpus
FINDINGS_ENV = "SHARDCACHE_FUZZ_FINDINGS"  # a file: one line per failing input saved
SECONDS_ENV = "SHARDCACHE_FUZZ_SECONDS"  # long profile: seconds of fuzzing per target
SCALE_ENV = "SHARDCACHE_FUZZ_SCALE"  # ci profile: a factor on every target's examples
TARGETS_ENV = "SHARDCACHE_FUZZ_TARGETS"  # comma-separated target names: fuzz only these (empty: all)
CORPUS = Path(__file__).parent / "corpus"
CPU_LIMIT_S = 2.0
ROUND_EXAMPLES = 200  # long profile: examples per Hypothesis run (a fresh random seed each)

_COMMON = dict(deadline=None, database=None, print_blob=False, suppress_health_check=list(HealthCheck))
# ci does not shrink: a failure fails the build as found (shrinking a slow reader's failure takes minutes);
# scripts/fuzz shrinks, so what it keeps in the corpus is small.
settings.register_profile("ci", derandomize=True, max_examples=100, phases=(Phase.explicit, Phase.generate),
                          **_COMMON)
settings.register_profile("long", derandomize=False, max_examples=ROUND_EXAMPLES,
                          phases=(Phase.explicit, Phase.generate, Phase.shrink), **_COMMON)


def profile_name() -> str:
    return os.environ.get(PROFILE_ENV, "ci")


def selected_targets() -> list[str]:
    wanted = {name for name in os.environ.get(TARGETS_ENV, "").split(",") if name}
    return [name for name in TARGETS if not wanted or name in wanted]


def scratch_dir() -> str | None:
    """Where inputs are put in place: memory (``/dev/shm``) when there is one, 9x faster to copy artifacts into
    than a disk; else the default temporary folder."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def run_input(target: Target, data: bytes, seeds: Seeds) -> Outcome:
    """``data`` through ``target``'s readers within the bounds (forked for a C parser), in a private folder
    removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix=f"shardcache-fuzz-{target.name}-", dir=scratch_dir()))
    try:
        with warnings.catch_warnings():  # a reader's warnings about odd input are not failures (nor output)
            warnings.simplefilter("ignore")
            return run_bounded(lambda: target.run(data, seeds, work), cpu_limit_s=CPU_LIMIT_S,
                               isolate=target.native)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class FuzzFailure(AssertionError):
    """A reader did what no reader may on hostile input. One subclass per finding (``failure_type``), so Hypothesis
    tells distinct bugs apart and shrinks each on its own."""


_FAILURE_TYPES: dict[str, type[FuzzFailure]] = {}


def failure_type(signature: str) -> type[FuzzFailure]:
    if signature not in _FAILURE_TYPES:
        name = "Fuzz_" + "".join(c if c.isalnum() else "_" for c in signature)[:80]
        _FAILURE_TYPES[signature] = type(name, (FuzzFailure,), {})
    return _FAILURE_TYPES[signature]


def case_path(target: Target, data: bytes) -> Path:
    return CORPUS / target.name / f"{hashlib.sha256(data).hexdigest()[:16]}.{target.suffix}"


def save_case(target: Target, data: bytes, outcome: Outcome, *, log: bool = True) -> Path:
    """Keep ``data`` as a regression case of ``target`` and log one line for it (``FINDINGS_ENV``)."""
    path = case_path(target, data)
    known = path.exists()  # found before (and replayed since): not news
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    findings = os.environ.get(FINDINGS_ENV)
    if log and findings and not known:
        with open(findings, "a", encoding="utf-8") as out:
            out.write(f"{target.name}\t{outcome.kind}: {outcome.exception} at {outcome.where}: "
                      f"{outcome.message[:200]}\t{path}\n")
    return path


def corpus_cases() -> list[tuple[str, Path]]:
    """Every saved case: ``(target, file)``."""
    if not CORPUS.is_dir():
        return []
    return [(folder.name, path) for folder in sorted(CORPUS.iterdir()) if folder.is_dir()
            for path in sorted(folder.iterdir()) if path.is_file() and not path.name.startswith(".")]


def _hypothesis_round(target: Target, seed: bytes, seeds: Seeds, found: dict[str, tuple[bytes, Outcome]],
                      config: settings) -> None:
    @config
    @given(st.data())
    def check(data: st.DataObject) -> None:
        payload = target.mutate(data.draw, seed)
        outcome = run_input(target, payload, seeds)
        if outcome.failed:
            # Shrinking replays each distinct bug last with its smallest input: the one kept.
            found[outcome.signature()] = (payload, outcome)
            raise failure_type(outcome.signature())(
                f"{target.name}: {outcome.describe()}\n  input: {len(payload)} bytes, {payload[:120]!r}")

    check()


def _keep(target: Target, found: dict[str, tuple[bytes, Outcome]], kept: dict[str, Path]) -> None:
    """Save each finding once (its smallest input so far) when ``SHARDCACHE_FUZZ_SAVE=1``."""
    if os.environ.get(SAVE_ENV) != "1":
        return
    for signature, (payload, outcome) in found.items():
        old = kept.get(signature)
        if old is None:
            kept[signature] = save_case(target, payload, outcome)
        elif len(payload) < old.stat().st_size and case_path(target, payload) != old:
            old.unlink(missing_ok=True)
            kept[signature] = save_case(target, payload, outcome, log=False)


def fuzz(name: str, seeds: Seeds) -> None:
    """Fuzz target ``name`` under the active profile; fails naming every distinct finding."""
    if name not in selected_targets():
        pytest.skip(f"not among {TARGETS_ENV}={os.environ.get(TARGETS_ENV)}")
    target = TARGETS[name]
    for artifact in target.needs:
        seeds.path(artifact)
    seed = target.seed(seeds)
    clean = run_input(target, seed, seeds)
    if clean.kind != "ok":
        pytest.fail(f"the valid {name} seed does not read cleanly: {clean.describe()}", pytrace=False)
    found: dict[str, tuple[bytes, Outcome]] = {}
    kept: dict[str, Path] = {}
    profile = settings.get_profile(profile_name())
    if profile_name() == "long":
        end = time.monotonic() + float(os.environ.get(SECONDS_ENV, "60"))
        while time.monotonic() < end:
            try:
                _hypothesis_round(target, seed, seeds, found, settings(profile))
            except Exception:  # noqa: BLE001 - recorded in ``found``; fuzzing goes on until the budget is spent
                pass
            _keep(target, found, kept)
    else:
        examples = max(1, round(target.examples * float(os.environ.get(SCALE_ENV, "1"))))
        try:
            _hypothesis_round(target, seed, seeds, found, settings(profile, max_examples=examples))
        finally:
            _keep(target, found, kept)
    if found:
        lines = [f"- {outcome.describe().splitlines()[0]} at {outcome.where} ({len(payload)}-byte input)"
                 for payload, outcome in found.values()]
        pytest.fail(f"{name}: {len(found)} finding(s):\n" + "\n".join(lines), pytrace=False)
