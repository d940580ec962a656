"""Saved loader states are untrusted input (issue 33): every field of a real saved state, tampered with a wrong
type or an out-of-range value, is an ``InputError`` naming the field, raised at once, in bounded time and memory;
nothing resumes from a position no run was at. The same through ``dcp_state`` and ``--resume`` checkpoints."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import time
import tracemalloc

import pytest
import torch

import shards
from shards.errors import CorruptDataError, InputError
from shards.position import dcp_state
from shards.position.dcp_state import KEY
from shards.position.shared_blocks import MAX_QUARANTINED
from shards.loader.loader import workers_mode
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset
from train.run.checkpoint import load_checkpoint, save_checkpoint

SIZES = {"train": [7, 5, 9, 3, 6]}  # 30 samples: 8 batches of 4
WRONG_TYPES = ["7", 2.5, True, None, math.nan, 1e30, [], {}]
# Out-of-range values per integer field (a world size of 1, so 2 nodes cannot divide it).
OUT_OF_RANGE = {
    "epoch": [-1, 2**31 + 1, 10**18],
    "batches": [-1, 10**18],
    "batch_size": [0, 10**12],
    "num_workers": [-1, 257, 10**18],
    "seed": [-1, 2**64],
    "world_size": [0, 10**18],
    "split_batch": [0, 10**12],
    "nodes": [0, 2, 10**18],
}
NULLABLE = {"quarantined", "prior", "excluded"}  # None means none
DROP = object()  # the field removed


def key_decoder(sample, seed):
    return 0


def tampered_values():
    """(field, value) for every field a saved state holds: wrong types, out-of-range values, odd shapes."""
    for field, values in OUT_OF_RANGE.items():
        for value in WRONG_TYPES + values:
            if not (value is None and field in NULLABLE):
                yield field, value
    for value in WRONG_TYPES + [0, 1, "yes"]:
        if value is not True:
            yield "drop_last", value
    for value in WRONG_TYPES + ["streams", "x" * 10_000]:
        yield "kind", value
    for value in WRONG_TYPES + ["x" * 10_000]:
        if value != "7":
            yield "dataset", value
    for value in WRONG_TYPES + [1, 3, 2**70]:
        yield "version", value
    for value in WRONG_TYPES:
        if value is not None:
            yield "prior", value
    for value in WRONG_TYPES + [["7"], [[1]], [[-1, "k"]], [[2.5, "k"]], [[True, "k"]], [[1, 7]], [[1, "k", 3]],
                                [[1, "k" * 10_000]], [[0, "k"]] * (MAX_QUARANTINED + 1)]:
        if value is not None and value != []:  # an empty list is no quarantine, as None is
            yield "quarantined", value
    for value in WRONG_TYPES + [["7"], [-1], [2.5], [True], [None], [10**30], [[1]]]:
        if value is not None and value != []:
            yield "excluded", value


SAMPLING = [("shuffle", "yes"), ("shuffle", None), ("shuffle_buffer", 2.5), ("shuffle_buffer", -1),
            ("class_weights", [math.nan]), ("class_weights", [-1.0]),
            ("class_weights", "balanced"), ("class_weights", [1.0] * (2**20 + 1)), ("drop_last", None),
            ("rotate_every", True), ("rotate_every", 0), ("feature_window", 2.5), ("surprise", 1),
            ("shuffle", DROP)]
CASES = list(tampered_values())


def case_id(case) -> str:
    field, value = case
    text = repr(value)
    return f"{field}={text if len(text) <= 24 else text[:21] + '...'}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("states")
    make_shard_dataset(out, shard_sizes=SIZES, size=(8, 8))
    return out


def build(folder, workers: int):
    dataset = shards.open_dataset(folder, return_keys=True, seed=3, decode=shards.Decode(decoder=key_decoder),
                                  sampling=shards.Sampling(shuffle_buffer=6))
    return shards.make_loader(dataset, batch_size=4, mode=workers_mode(workers, persistent=False), drop_last=False,
                              pin_memory=False)


@pytest.fixture(scope="module")
def saved(folder):
    """A real state: 3 batches of a loader with 2 worker processes."""
    loader = build(folder, 2)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    del batches
    return state


@pytest.fixture(scope="module")
def continued(folder, saved):
    """A real state with a ``prior``: the 2-worker state continued without workers (another layout), 1 batch on."""
    loader = build(folder, 0)
    loader.load_state_dict(saved)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    assert state["prior"] is not None and state["prior"]["num_workers"] == 2
    return state


def target(folder, state):
    """A fresh loader in the layout that saved ``state`` (no worker starts: nothing is iterated)."""
    return build(folder, state["num_workers"])


@contextlib.contextmanager
def bounded(seconds: float = 5.0, megabytes: int = 64):
    """Fail if the block runs longer than ``seconds`` (interrupted, so a loop without end fails, not hangs) or
    allocates more than ``megabytes`` at its peak."""
    def interrupt(*_):
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < megabytes << 20, f"peak {peak >> 20} MiB"


def refused(loader, state, field: str) -> str:
    with bounded():
        with pytest.raises(InputError) as raised:
            loader.load_state_dict(state)
    message = str(raised.value)
    assert field in message, message
    assert "\n" not in message and len(message) < 600, message
    return message


def with_value(state, path, value):
    state = copy.deepcopy(state)
    record = state
    for name in path[:-1]:
        record = record[name]
    if value is DROP:
        del record[path[-1]]
    else:
        record[path[-1]] = value
    return state


# -- every field, at the top and inside ``prior`` --------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_tampered_field_is_refused_naming_it(folder, saved, case):
    field, value = case
    refused(target(folder, saved), with_value(saved, [field], value), f"loader state {field}")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_tampered_field_of_the_state_it_continued_is_refused_naming_it(folder, continued, case):
    field, value = case
    refused(target(folder, continued), with_value(continued, ["prior", field], value), f"loader state prior.{field}")


@pytest.mark.parametrize("field", ["kind", "epoch", "batches", "batch_size", "num_workers", "drop_last", "seed",
                                   "world_size", "split_batch", "dataset", "sampling", "prior", "nodes",
                                   "quarantined"])
def test_a_missing_field_is_refused_naming_it(folder, continued, field):
    refused(target(folder, continued), with_value(continued, [field], DROP), f"lacks {field}")
    refused(target(folder, continued), with_value(continued, ["prior", field], DROP),
            f"prior of version 2 lacks {field}")


@pytest.mark.parametrize("setting", SAMPLING, ids=lambda s: f"{s[0]}={str(s[1])[:12]}")
def test_a_tampered_sampling_setting_is_refused_naming_it(folder, saved, setting):
    name, value = setting
    refused(target(folder, saved), with_value(saved, ["sampling", name], value), "loader state sampling")


def test_a_state_that_is_no_object_is_refused(folder, saved):
    for value in WRONG_TYPES + [[saved]]:
        if value != {}:
            refused(target(folder, saved), value, "loader state")


# -- nothing resumes from a position no run was at ---------------------------------------------------------------
def test_more_batches_than_the_epoch_has_are_refused_not_clamped(folder, saved):
    loader = target(folder, saved)
    batches = len(loader)
    message = refused(loader, {**saved, "batches": batches + 1}, "loader state batches")
    assert f"{batches} batches" in message
    # the end of the epoch is a position (made by hand: without the audit record, which says where the run was)
    loader.load_state_dict({**saved, "batches": batches, "audit": None})


def test_more_batches_than_the_continued_layouts_epoch_had_are_refused(folder, continued):
    # The 2-worker layout's epoch had 8 batches: a prior claiming 19 of them (and its successor 20) is refused.
    state = with_value(with_value(continued, ["batches"], 20), ["prior", "batches"], 19)
    refused(target(folder, continued), state, "loader state prior.batches")
    refused(target(folder, continued), with_value(continued, ["batches"], 99), "loader state batches")
    refused(target(folder, continued), with_value(continued, ["prior", "batches"], continued["batches"] + 1),
            "loader state prior.batches")


def test_a_feature_loader_refuses_batches_beyond_its_epoch(tmp_path):
    write_feature_dataset(tmp_path, [10, 7])

    def loader():
        return shards.make_loader(shards.open_dataset(tmp_path, seed=1), batch_size=4, drop_last=False)

    first = loader()
    next(iter(first))
    state = first.state_dict()
    total = len(first)
    refused(loader(), {**state, "batches": total + 1}, "loader state batches")


def test_a_quarantined_row_outside_the_split_is_refused(folder, saved):
    refused(target(folder, saved), {**saved, "quarantined": [[10**6, "k"]]}, "loader state quarantined")


@pytest.mark.parametrize("shape", ["deep", "long"])
@pytest.mark.slow
def test_a_huge_or_deep_value_is_refused_in_bounded_time_and_memory(folder, saved, shape):
    value: list = []
    if shape == "deep":
        for _ in range(100_000):
            value = [value]
    else:
        value = list(range(10_000_000))
    refused(target(folder, saved), {**saved, "epoch": value}, "loader state epoch")


@pytest.mark.slow  # builds a 100,000-deep chain
def test_a_prior_chain_nested_without_end_is_refused_at_once(folder, continued):
    chain = None
    for _ in range(100_000):
        chain = {**continued["prior"], "prior": chain}
    state = {**continued, "prior": chain}
    message = refused(target(folder, continued), state, "loader state prior.prior.")
    assert "may continue at most" in message


@pytest.mark.slow  # over half a second in the quick loop
def test_a_refused_state_leaves_the_loader_as_it_was(folder, saved):
    loader = target(folder, saved)
    full = [list(batch[2]) for batch in target(folder, saved)]
    for field, value in CASES[::7]:
        with pytest.raises(InputError):
            loader.load_state_dict(with_value(saved, [field], value))
    assert loader.epoch == 0 and loader.quarantined == ()
    assert [list(batch[2]) for batch in loader] == full


def test_batches_consumed_must_be_an_integer(folder):
    loader = build(folder, 0)
    batches = iter(loader)
    next(batches)
    next(batches)
    for value in (1.5, True, "1", -1, 3):
        with pytest.raises(InputError, match="batches_consumed"):
            loader.state_dict(batches_consumed=value)


# -- dcp_state ---------------------------------------------------------------------------------------------------
def test_dcp_state_refuses_a_tampered_field_naming_it(folder, saved):
    for field, value in [("batches", 2.5), ("epoch", math.nan), ("num_workers", 10**18), ("prior", [])]:
        loader = target(folder, saved)
        with bounded(), pytest.raises(InputError, match=f"loader state {field}"):
            loader.dcp_state().load_state_dict({KEY: json.dumps({**saved, field: value})})


def test_dcp_state_refuses_json_nested_without_end(folder, saved):
    text = "[" * 100_000 + "]" * 100_000
    with bounded(), pytest.raises(InputError, match="nested deeper"):
        target(folder, saved).dcp_state().load_state_dict({KEY: text})


def test_dcp_state_refuses_an_entry_longer_than_a_state(folder, saved, monkeypatch):
    monkeypatch.setattr(dcp_state, "MAX_STATE_CHARS", 1_000)
    with pytest.raises(InputError, match="more than a loader state"):
        target(folder, saved).dcp_state().load_state_dict({KEY: json.dumps({**saved, "pad": "x" * 2_000})})


# -- --resume checkpoints -----------------------------------------------------------------------------------------
def test_a_checkpoint_with_a_tampered_loader_state_is_refused_naming_file_and_field(tmp_path, saved):
    for field, value in [("batches", 2.5), ("num_workers", 10**18), ("epoch", torch.tensor(3)),
                         ("quarantined", [[0, "k"]] * (MAX_QUARANTINED + 1))]:
        path = tmp_path / f"{field}.pt"
        save_checkpoint(path, {"loader": {**saved, field: value}})
        with bounded(megabytes=256), pytest.raises(InputError, match=f"loader state {field}") as raised:
            load_checkpoint(path)
        assert str(path) in str(raised.value) and "\n" not in str(raised.value)
    save_checkpoint(tmp_path / "good.pt", {"loader": saved})
    assert load_checkpoint(tmp_path / "good.pt")["loader"] == saved


class Pickled:
    """An object a checkpoint should never hold."""


def test_the_weights_only_refusal_does_not_repeat_torchs_advice(tmp_path):
    path = tmp_path / "pickled.pt"
    torch.save({"checkpoint_version": 1, "loader": Pickled()}, path)
    with pytest.raises(CorruptDataError) as raised:
        load_checkpoint(path)
    message = str(raised.value)
    assert "\n" not in message and "\x1b" not in message
    assert "weights_only=False" not in message and "False" not in message and "add_safe_globals" not in message
    assert "Pickled" in message and str(path) in message


def test_a_checkpoint_of_another_version_or_kind_of_file_is_refused(tmp_path):
    torch.save({"checkpoint_version": True, "loader": None}, tmp_path / "bool.pt")  # True == 1, but not a version
    with pytest.raises(CorruptDataError, match="not a shardcache checkpoint"):
        load_checkpoint(tmp_path / "bool.pt")
    os.mkfifo(tmp_path / "fifo.pt")
    started = time.monotonic()
    with pytest.raises(CorruptDataError, match="not a regular file"):
        load_checkpoint(tmp_path / "fifo.pt")
    assert time.monotonic() - started < 5
