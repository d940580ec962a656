"""The fuzz targets' registry: what a target is, and the decorator that registers one.

A target is one parser entry point: its input is the bytes of one file (or one expression), and
``run(data, seeds, work)`` puts them in place in a private copy of a valid artifact under ``work`` (re-recording
sizes and checksums that name the file) and calls the readers a user would. The input alone is what
``tests/fuzz/corpus/<target>/`` keeps, so a saved case replays without Hypothesis. The targets themselves are in
``tests/fuzz/targets.py`` (files of datasets, feature and run folders, pack-shards inputs) and
``tests/fuzz/targets_state.py`` (saved loader states, the node cache's shared folder, ``where`` filters).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from tests.fuzz.mutate import Draw
from tests.fuzz.seeds import Seeds


@dataclasses.dataclass(frozen=True)
class Target:
    """One parser entry point: its valid input, how to mutate it, and how to read an input (see the module)."""

    name: str
    seed: Callable[[Seeds], bytes]  # the valid input, read from the artifact
    mutate: Callable[[Draw, bytes], bytes]
    run: Callable[[bytes, Seeds, Path], Any]
    suffix: str = "bin"  # of corpus files
    examples: int = 100  # the ci profile's max_examples (sized so the suite runs in about 2 minutes)
    needs: tuple[str, ...] = ()  # artifacts ``run`` reads besides the seed's own (built before any fork)
    native: bool = False  # ``run`` hands the input to a C parser (h5py, pyarrow, torch.load): run it forked


TARGETS: dict[str, Target] = {}


def target(name: str, seed: Callable[[Seeds], bytes], mutate: Callable[[Draw, bytes], bytes], *,
           suffix: str = "bin", examples: int = 100, needs: tuple[str, ...] = (), native: bool = False) -> Callable:
    """Register the decorated ``run(data, seeds, work)`` as target ``name``."""
    def register(run: Callable[[bytes, Seeds, Path], Any]) -> Callable:
        TARGETS[name] = Target(name, seed, mutate, run, suffix, examples, needs, native)
        return run
    return register


def file_of(artifact: str, name: str) -> Callable[[Seeds], bytes]:
    """A seed: the bytes of file ``name`` of artifact ``artifact``."""
    return lambda seeds: (seeds.path(artifact) / name).read_bytes()
