"""Run mode ``Threads`` (``shards.loader.threads``), threads inside worker processes (``WorkerProcesses(decoders=)``)
and ``Auto`` (``shards.loader.auto``): the same batches as worker processes, states that cross between modes, the
batch filled in place, errors and stalls in a thread, the trial that picks a mode."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch
import torchvision.transforms as T
from torch.utils.data._utils.collate import default_collate

import shards
from shards.errors import CorruptDataError, InputError
from shards.loader.auto import CUT_AFTER, Auto, cut_short, gil_enabled
from shards.loader.batch_fill import BatchFill
from shards.loader.in_process import InProcess
from shards.loader.loader import pad_collate
from shards.loader.threads import THREAD_NAME, Threads
from shards.loader.watchdog import StallPolicy
from shards.loader.worker_processes import WorkerProcesses
from shards.procs.stage_times import WORKER_STAGES
from tests.helpers import make_shard_dataset
from tests.shards.budget_helpers import smallest_budget
from tests.shards.stream_helpers import write_feature_dataset

TRAIN = shards.TransformSpec(preset="train", size=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("threads")
    make_shard_dataset(root, shard_sizes={"train": [7, 5, 9, 6], "val": [4]}, size=(24, 20))
    return root


def fast(folder, **options):
    return shards.open_dataset(folder, "train", seed=3, return_keys=True, transform=TRAIN,
                               decode=shards.Decode("fast"), **options)


def epochs(loader, count=2):
    out = []
    for epoch in range(count):
        loader.set_epoch(epoch)
        out += [(batch[0].clone(), batch[1].clone(), list(batch[2])) for batch in loader]
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2]
                                    for x, y in zip(a, b))


@pytest.fixture(scope="module")
def reference(folder):
    """Two epochs of augmented uint8 batches from two worker processes."""
    return epochs(shards.make_loader(fast(folder), 4, mode=WorkerProcesses(2, persistent=False), drop_last=False))


@pytest.mark.parametrize("mode", [Threads(2), Threads(2, decoders=3), Threads(2, prefetch=1),
                                  WorkerProcesses(2, persistent=False, decoders=3)], ids=str)
def test_every_mode_of_two_workers_feeds_the_batches_of_two_worker_processes(folder, reference, mode):
    assert same(epochs(shards.make_loader(fast(folder), 4, mode=mode, drop_last=False)), reference)


@pytest.mark.parametrize("mode", [Threads(2), Threads(2, decoders=3),
                                  pytest.param(WorkerProcesses(2, persistent=False, decoders=3), marks=pytest.mark.slow),
                                  pytest.param(WorkerProcesses(2, persistent=False), marks=pytest.mark.slow)], ids=str)
def test_the_smallest_memory_budget_feeds_the_same_batches_in_every_mode(folder, reference, mode):
    """The budget sizes queues, prefetch and decode-ahead: the same augmented pixels, labels and keys, in order."""
    def make(memory):
        return shards.make_loader(fast(folder), 4, mode=mode, drop_last=False, memory=memory)

    smallest = smallest_budget(make)
    assert smallest > 1  # a budget this mode counts against
    assert same(epochs(make(smallest)), reference)


# One saved state for every mode (the cursor's): the full suite crosses both ways (over half a second each).
@pytest.mark.parametrize("saved_in,resumed_in", [pytest.param(Threads(2), WorkerProcesses(2, persistent=False), marks=pytest.mark.slow),
                                                  pytest.param(WorkerProcesses(2, persistent=False), Threads(2),
                                                               marks=pytest.mark.slow)], ids=str)
def test_a_state_saved_in_one_mode_continues_exactly_in_the_other(folder, saved_in, resumed_in):
    full = epochs(shards.make_loader(fast(folder), 4, mode=saved_in, drop_last=False), 1)
    for taken in (1, 3, len(full) - 1):
        interrupted = shards.make_loader(fast(folder), 4, mode=saved_in, drop_last=False)
        iterator = iter(interrupted)
        head = [next(iterator) for _ in range(taken)]
        state = interrupted.state_dict()
        interrupted.close()
        resumed = shards.make_loader(fast(folder), 4, mode=resumed_in, drop_last=False)
        resumed.load_state_dict(state)
        rest = [(b[0], b[1], list(b[2])) for b in resumed]
        assert same([(b[0], b[1], list(b[2])) for b in head] + rest, full)


def test_batches_have_default_collates_structure_and_fill_in_place():
    samples = [(torch.full((3, 2, 2), i, dtype=torch.uint8), i, f"k{i}") for i in range(5)]
    fill = BatchFill(3)
    batches = []
    for sample in samples:
        fill.add(sample)
        if fill.count == 3:
            batches.append(fill.take())
    batches.append(fill.take())  # a partial last batch: the allocated rows it has
    for got, expected in zip(batches, (default_collate(samples[:3]), default_collate(samples[3:]))):
        assert type(got) is list and len(got) == 3
        assert torch.equal(got[0], expected[0]) and got[0].dtype == torch.uint8
        assert torch.equal(got[1], expected[1]) and got[1].dtype == expected[1].dtype == torch.int64
        assert got[2] == expected[2]


def test_samples_that_do_not_fit_one_tensor_are_collated_as_a_list():
    fill = BatchFill(3, collate_fn=None)
    fill.add((torch.zeros(3, 2, 2), 0))
    fill.add((torch.ones(3, 4, 4), 1))  # another size: what default_collate says of it, it says here
    with pytest.raises(RuntimeError, match="equal size"):
        fill.take()
    padded = BatchFill(2, collate_fn=pad_collate)
    padded.add((torch.zeros(3, 2, 2), 0))
    padded.add((torch.ones(3, 4, 4), 1))
    batch = padded.take()
    assert batch["images"].shape == (2, 3, 4, 4) and batch["mask"][0].sum() == 4


def test_threads_keep_a_quarantined_sample_out_as_processes_do(folder):
    def fed(mode):
        loader = shards.make_loader(fast(folder), 4, mode=mode, drop_last=False)
        loader.keep_out({5: "train_00005"})
        return [key for batch in loader for key in batch[2]]

    threads, processes = fed(Threads(2)), fed(WorkerProcesses(2, persistent=False))
    assert threads == processes and "train_00005" not in threads and len(threads) == 27


def test_threads_add_every_stage_and_leave_the_callers_torch_settings(folder):
    torch.manual_seed(11)
    before, threads = torch.random.get_rng_state(), torch.get_num_threads()
    loader = shards.make_loader(fast(folder), 4, mode=Threads(2), drop_last=False)
    assert sum(len(batch[1]) for batch in loader) == 27
    seconds = loader.stage_seconds()
    assert all(seconds[stage] > 0 for stage in WORKER_STAGES), seconds
    assert torch.equal(torch.random.get_rng_state(), before) and torch.get_num_threads() == threads


def test_leaving_an_epoch_early_stops_its_threads(folder):
    loader = shards.make_loader(fast(folder), 2, mode=Threads(3), drop_last=False)
    iterator = iter(loader)
    next(iterator)
    assert any(t.name.startswith(THREAD_NAME) for t in threading.enumerate())
    iterator.close()
    deadline = time.monotonic() + 5
    while any(t.name.startswith(THREAD_NAME) for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name.startswith(THREAD_NAME) for t in threading.enumerate())
    assert sum(len(batch[1]) for batch in loader) == 27  # and the next iteration is a whole epoch


class BrokenOn:
    """A decoder that fails on one key: a bad sample (``CorruptDataError``) or a bug (``RuntimeError``)."""

    def __init__(self, key: str, error: type):
        self.key, self.error = key, error

    def __call__(self, sample, seed):
        if sample.key == self.key:
            raise self.error("cannot decode this one")
        return torch.zeros(2)


def test_a_bad_sample_in_a_thread_is_skipped_or_raised_as_in_processes(folder):
    def dataset(on_error):
        return shards.open_dataset(folder, "train", seed=3, errors=shards.ErrorPolicy(on_error=on_error),
                                   decode=shards.Decode(decoder=BrokenOn("train_00004", CorruptDataError)))

    skipping = dataset("skip")
    assert sum(len(b[1]) for b in shards.make_loader(skipping, 4, mode=Threads(2), drop_last=False)) == 27
    assert skipping.skipped == 1
    with pytest.raises(CorruptDataError, match=r"train-00000.*\[sample train_00004\]"):
        list(shards.make_loader(dataset("raise"), 4, mode=Threads(2), drop_last=False))
    bug = shards.open_dataset(folder, "train", seed=3, decode=shards.Decode(decoder=BrokenOn("train_00004",
                                                                                              RuntimeError)))
    with pytest.raises(RuntimeError, match="cannot decode this one"):
        list(shards.make_loader(bug, 4, mode=Threads(2), drop_last=False))


class HangsOn:
    """A decoder that hangs on one key until released."""

    def __init__(self, key: str):
        self.key = key
        self.release = threading.Event()

    def __call__(self, sample, seed):
        if sample.key == self.key:
            self.release.wait(30)
        return torch.zeros(2)


@pytest.mark.slow
@pytest.mark.parametrize("decoders", [0, 2])
def test_a_hung_decoder_in_a_thread_is_an_error_naming_the_sample_and_its_frame(folder, tmp_path, decoders):
    decoder = HangsOn("train_00009")
    dataset = shards.open_dataset(folder, "train", seed=3, decode=shards.Decode(decoder=decoder))
    loader = shards.make_loader(dataset, 2, mode=Threads(2, decoders=decoders), drop_last=False,
                                stall=StallPolicy(0.5, stack_dir=str(tmp_path)))
    began = time.monotonic()
    try:
        with pytest.raises(CorruptDataError) as raised:
            list(loader)
    finally:
        decoder.release.set()
    message = str(raised.value)
    assert time.monotonic() - began < 10 and "\n" not in message
    assert "[sample train_00009]" in message and "train-000001.tar" in message  # row 9 is in the second shard
    assert "at __call__ (test_threads.py:" in message and "WorkerProcesses(n)" in message
    dumps = list(tmp_path.glob("loader-threads-*.txt"))
    assert len(dumps) == 1 and "self.release.wait(30)" in dumps[0].read_text()


def test_a_transform_that_draws_from_torchs_generator_is_refused_in_threads(folder):
    dataset = shards.open_dataset(folder, "train", seed=3, transform=T.Compose([T.RandomHorizontalFlip(),
                                                                                 T.PILToTensor()]))
    with pytest.raises(InputError, match="global random generator.*WorkerProcesses"):
        shards.make_loader(dataset, 4, mode=Threads(2))
    assert shards.make_loader(dataset, 4, mode=WorkerProcesses(1)).mode == WorkerProcesses(1)


def test_threads_refuse_bad_settings_in_one_line():
    for bad in (dict(workers=0), dict(workers=2.0), dict(workers=2, decoders=-1), dict(workers=2, prefetch=0)):
        with pytest.raises(InputError, match="Threads") as raised:
            Threads(**bad)
        assert "\n" not in str(raised.value)
    with pytest.raises(InputError, match=r"WorkerProcesses\(threads=0\): decode threads are decoders="):
        WorkerProcesses(2, threads=0)


# -- Auto -----------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # over half a second in the quick loop
def test_auto_feeds_exactly_the_batches_of_its_plan_through_the_trial_and_after(folder):
    """The trial switches modes mid-epoch (and goes on into the next epoch when one ends first): the batches are
    those of any candidate alone."""
    reference = epochs(shards.make_loader(fast(folder), 2, mode=WorkerProcesses(2, persistent=False),
                                          drop_last=False), 3)
    loader = shards.make_loader(fast(folder), 2, mode=Auto(2, trial_batches=5, warmup_batches=1), drop_last=False)
    assert same(epochs(loader, 3), reference)
    choice = loader.mode_choice()
    trial = {entry["mode"]: entry for entry in choice["trial"]}
    assert len(trial) == len(Auto(2).candidates())
    cut = choice["cut"]  # a candidate half again as slow as one before it (a busy box) stops after 3
    assert all(entry["batches"] == (3 if mode in cut else 10 if mode in choice["runoff"] else 5)
               for mode, entry in trial.items())
    fastest = min((trial[mode] for mode in choice["runoff"] or trial), key=lambda entry: entry["step_s"])
    assert choice["chosen"] == fastest["mode"]
    assert all(0 <= entry["wait_s"] <= entry["step_s"] for entry in trial.values())


@pytest.mark.slow  # two runs of the trial
@pytest.mark.parametrize("runoff_percent", [0, 1000])
def test_a_runoff_times_the_two_best_again_and_changes_nothing_that_is_fed(folder, runoff_percent, caplog):
    """1000%: every trial has a runoff (its second turns start fresh runs: worker processes again, with their warm-up
    untimed); 0: none. The batches are the plan's either way, and the log line of the choice says which it was."""
    reference = epochs(shards.make_loader(fast(folder), 2, mode=Threads(2), drop_last=False), 4)
    mode = Auto(2, trial_batches=3, warmup_batches=1, runoff_percent=runoff_percent)
    loader = shards.make_loader(fast(folder), 2, mode=mode, drop_last=False)
    with caplog.at_level("INFO", logger="shards.loader.auto"):
        assert same(epochs(loader, 4), reference)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run mode: ")]
    assert ("after a runoff against" in line) == bool(runoff_percent)
    choice = loader.mode_choice()
    trial = {entry["mode"]: entry["batches"] for entry in choice["trial"]}
    assert choice["chosen"] is not None
    assert set(trial.values()) - {3, 6} == set()  # a candidate cut short after 3 (CUT_AFTER) has 3 too
    if runoff_percent:
        assert len(choice["runoff"]) == 2 and choice["chosen"] in choice["runoff"]
        assert sorted(trial.values()) == [3] * (len(trial) - 2) + [6, 6]
    else:
        assert choice["runoff"] == [] and set(trial.values()) == {3}


@dataclass(frozen=True)
class SlowThreads(Threads):
    """``Threads`` whose every batch comes 0.1 s late: a candidate that does not suit the node."""

    def start(self, loader):
        run = super().start(loader)
        batches = run.batches

        def late():
            for batch in batches():
                time.sleep(0.1)
                yield batch

        run.batches = late
        return run


@dataclass(frozen=True)
class TwoSpeeds(Auto):
    order: tuple = ("fast", "slow")

    def candidates(self, gil=None, cpus=None):
        made = {"fast": Threads(self.workers), "slow": SlowThreads(self.workers)}
        return [made[name] for name in self.order]


@pytest.mark.slow  # two trials beside a candidate at 0.1 s a batch: 2.5 s
def test_a_candidate_half_again_as_slow_as_one_timed_before_it_is_cut_short(folder):
    """Cut after CUT_AFTER timed steps, and still the plan's batches; the first candidate has nothing to be cut
    against, so a slow first one takes its whole turn."""
    reference = epochs(shards.make_loader(fast(folder), 2, mode=Threads(2), drop_last=False), 2)
    for order, batches in ((("fast", "slow"), {"fast": 6, "slow": CUT_AFTER}), (("slow", "fast"), None)):
        mode = TwoSpeeds(2, trial_batches=6, warmup_batches=1, order=order)
        loader = shards.make_loader(fast(folder), 2, mode=mode, drop_last=False)
        assert same(epochs(loader, 2), reference)
        choice = loader.mode_choice()
        timed = {entry["mode"].split("(")[0]: entry["batches"] for entry in choice["trial"]}
        assert choice["chosen"] == str(Threads(2)) and choice["runoff"] == []
        if batches is not None:
            assert choice["cut"] == [str(SlowThreads(2))] and timed == {"Threads": 6, "SlowThreads": CUT_AFTER}
        else:
            assert choice["cut"] == [] and timed == {"SlowThreads": 6, "Threads": 6}


def test_cut_short_needs_its_steps_and_a_finished_candidate_half_again_as_fast():
    assert not cut_short([0.9, 0.9], [[0.1]])  # fewer than CUT_AFTER steps: not yet
    assert cut_short([0.16] * CUT_AFTER, [[0.2, 0.2], [0.1]])  # 1.6x the best finished one
    assert not cut_short([0.15] * CUT_AFTER, [[0.1]])  # 1.5x exactly: kept
    assert not cut_short([0.9] * CUT_AFTER, [])  # nothing finished before it
    assert not cut_short([0.9] * CUT_AFTER, [[]])  # nor anything timed


def test_auto_is_undecided_until_every_candidate_was_tried(folder):
    """Worker processes feed their queue's 8 batches untimed (made before the loop asked), then 3 timed; the epoch's
    last 3 batches are the threads' warm-up."""
    loader = shards.make_loader(fast(folder), 2, mode=Auto(2, trial_batches=3, warmup_batches=0), drop_last=False)
    assert sum(1 for _ in loader) == len(loader) == 14
    choice = loader.mode_choice()
    assert choice["chosen"] is None and [entry["batches"] for entry in choice["trial"]][:2] == [3, 0]
    assert WorkerProcesses(2).batches_ahead == 8 and Threads(2).batches_ahead == 6


def test_auto_candidates_put_threads_first_without_a_gil():
    auto = Auto(2)
    assert auto.candidates(gil=True, cpus=2) == [WorkerProcesses(2), Threads(2)]
    assert auto.candidates(gil=False, cpus=2) == [Threads(2), WorkerProcesses(2)]
    assert auto.candidates(gil=True, cpus=8) == [WorkerProcesses(2), WorkerProcesses(2, decoders=2),
                                                 WorkerProcesses(2, decoders=4), Threads(2), Threads(2, decoders=4),
                                                 Threads(2, decoders=8)]  # half and all of the CPUs decoding
    with pytest.raises(InputError, match="trial_batches"):
        Auto(2, trial_batches=0)


def test_make_loader_auto_chooses_among_the_default_plans_modes(folder, tmp_path):
    images = shards.make_loader(fast(folder), 4, mode="auto")
    assert isinstance(images.mode, Auto) and images.mode.workers == shards.make_loader(fast(folder), 4).num_workers
    write_feature_dataset(tmp_path / "features", [5, 6])
    features = shards.make_loader(shards.open_dataset(tmp_path / "features", "train"), 4, mode="auto")
    assert features.mode == InProcess() and features.mode_choice() is None


@pytest.mark.slow
def test_importing_shardcache_and_its_decoders_leaves_the_gil_as_the_interpreter_started():
    """On a free-threaded build an extension module without free-threading support turns the GIL back on when
    imported (torchcodec#1701 did): threads would then decode one at a time. The interpreter's own build says
    what the GIL should be; importing everything a loader decodes with must leave it so."""
    code = ("import sys, sysconfig\n"
            "expected = not sysconfig.get_config_var('Py_GIL_DISABLED')\n"
            "import shards, shards.image.fast, shards.image.decode, shards.loader.threads, simplejpeg, PIL.Image\n"
            "import torchvision.transforms.v2.functional\n"
            "from shards.image.device import _torchcodec_decode_jpeg\n"
            "_torchcodec_decode_jpeg()\n"  # torchcodec, where it loads (torchcodec#1701 turned the GIL on)
            "from shards.loader.auto import gil_enabled\n"
            "print(expected, gil_enabled())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    expected, enabled = result.stdout.split()
    assert enabled == expected, f"importing shardcache turned the GIL {'on' if enabled == 'True' else 'off'}"
    assert gil_enabled() == (expected == "True")


def test_auto_leaves_out_a_mode_that_cannot_run_the_dataset(folder):
    dataset = shards.open_dataset(folder, "train", seed=3, transform=T.Compose([T.RandomHorizontalFlip(),
                                                                                 T.PILToTensor()]))
    loader = shards.make_loader(dataset, 4, mode=Auto(1, trial_batches=2, warmup_batches=0), drop_last=False)
    assert sum(len(batch[1]) for batch in loader) == 27
    modes = [entry["mode"] for entry in loader.mode_choice()["trial"]]
    assert modes and not any(mode.startswith("Threads") for mode in modes)
