"""``Auto``'s candidates and its choice as pure functions: decode widths from the CPU count, and the mode picked
from injected step times (no timing here), the same every time for the same measurements; which two a runoff times
again."""

from __future__ import annotations

import pytest

from shards.errors import InputError
from shards.loader.auto import MAX_DECODE_WIDTH, Auto, choose, decode_widths, runoff_pair
from shards.loader.threads import Threads
from shards.loader.worker_processes import WorkerProcesses


def decoding_at_once(mode) -> int:
    """How many images a candidate decodes at once: its decode threads, or one per logical worker."""
    if isinstance(mode, Threads):
        return mode.decoders or mode.workers
    return mode.workers * (mode.decoders or 1)


@pytest.mark.parametrize("cpus", [1, 2, 3, 4, 16, 96, 512])
def test_decode_widths_are_half_and_all_of_the_cpus_within_bounds(cpus):
    widths = decode_widths(cpus)
    assert widths == sorted(set(widths)) and all(2 <= w <= MAX_DECODE_WIDTH for w in widths)
    assert min(cpus, MAX_DECODE_WIDTH) in widths or cpus < 2
    assert len(widths) <= 2


def test_one_worker_on_two_cpus_also_tries_both_cpus_decoding():
    """The case issue 45 measured: every candidate decoded one image at a time (0.8x the best explicit mode)."""
    modes = Auto(1).candidates(gil=True, cpus=2)
    assert modes == [WorkerProcesses(1), WorkerProcesses(1, decoders=2), Threads(1), Threads(1, decoders=2)]
    assert {decoding_at_once(m) for m in modes} == {1, 2}
    assert all(m.workers == 1 for m in modes)  # one plan: the trial changes nothing that is fed


@pytest.mark.parametrize("workers,cpus", [(1, 16), (8, 16), (4, 64), (3, 7), (16, 8)])
def test_candidates_keep_the_plan_and_span_one_worker_each_to_all_cpus(workers, cpus):
    modes = Auto(workers).candidates(gil=False, cpus=cpus)
    assert len(modes) == len(set(modes)) <= 6 and all(m.workers == workers for m in modes)
    assert isinstance(modes[0], Threads)  # no GIL: threads first
    widths = {decoding_at_once(m) for m in modes}
    assert workers in widths and max(widths) >= min(cpus, MAX_DECODE_WIDTH)
    assert all(w <= max(workers, MAX_DECODE_WIDTH) for w in widths)


def test_choose_takes_the_lowest_mean_step_and_breaks_ties_by_order():
    a, b, c = WorkerProcesses(1), Threads(1), Threads(1, decoders=2)
    assert choose({a: [0.30, 0.10], b: [0.19, 0.19], c: [0.25, 0.2]}) == b
    assert choose({a: [0.2, 0.2], b: [0.1, 0.3], c: [0.3]}) == a  # a tie on the mean: the earlier candidate
    assert choose({b: [0.1, 0.3], a: [0.2, 0.2], c: [0.3]}) == b
    assert choose({a: [], b: [5.0]}) == b  # never timed: never chosen


def test_choose_picks_the_best_of_many_injected_trials_every_time():
    modes = Auto(2).candidates(gil=True, cpus=16)
    for trial in range(50):
        steps = {m: [0.1 + ((i * 7 + trial * 3) % 11) / 100 + k / 1000 for k in range(3)]
                 for i, m in enumerate(modes)}
        best = min(sum(v) / len(v) for v in steps.values())
        chosen = choose(steps)
        assert sum(steps[chosen]) / len(steps[chosen]) == best
        assert choose(dict(steps)) == chosen


def test_choose_with_nothing_to_choose_from_says_so():
    with pytest.raises(InputError, match="no candidate"):
        choose({})


def test_a_runoff_takes_the_two_best_when_the_second_is_within_the_margin():
    a, b, c = WorkerProcesses(1), Threads(1), Threads(1, decoders=2)
    assert runoff_pair({a: [0.104], b: [0.100], c: [0.200]}, 10) == [a, b]  # in trial order, not by speed
    assert runoff_pair({a: [0.300], b: [0.100], c: [0.1099]}, 10) == [b, c]
    assert runoff_pair({a: [0.111], b: [0.100], c: [0.200]}, 10) == []  # 11% apart: a clear winner
    assert runoff_pair({a: [0.111], b: [0.100], c: [0.200]}, 12) == [a, b]
    assert runoff_pair({a: [0.100], b: [0.100]}, 0) == []  # 0: no runoff, however close
    assert runoff_pair({a: [0.100], b: []}, 10) == []  # one timed: nothing to run off against
    assert runoff_pair({a: [0.1], b: [0.1], c: [0.1]}, 10) == [a, b]  # a three-way tie: the first two tried


def test_the_runoff_margin_is_a_whole_percent_in_every_spelling():
    assert Auto(2).runoff_percent == 10
    assert Auto.parse("auto:2,runoff_percent=0") == Auto(2, runoff_percent=0)
    assert Auto.parse(Auto(3, runoff_percent=25).to_json()) == Auto(3, runoff_percent=25)
    for bad in (-1, 0.5, True):
        with pytest.raises(InputError, match="runoff_percent") as raised:
            Auto(2, runoff_percent=bad)
        assert "\n" not in str(raised.value)
