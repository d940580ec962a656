"""One ``Loader``, run modes as values (``shards.loader.base``): every mode offers the same methods, a mode that cannot
apply stall recovery refuses it, and the quarantine is the loader's cursor's, never the dataset's."""

from __future__ import annotations

import dataclasses

import pytest

import shards
from shards.errors import InputError
from shards.loader.base import Loader
from shards.loader.auto import Auto
from shards.loader.in_process import InProcess
from shards.loader.threads import Threads
from shards.loader.loader import workers_mode
from shards.procs.stage_times import WORKER_STAGES
from shards.loader.watchdog import StallPolicy
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset


def key_decoder(sample, seed):
    return 0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes")
    make_shard_dataset(root / "images", shard_sizes={"train": [7, 5, 9]}, size=(8, 8))
    write_feature_dataset(root / "features", [10, 11])
    return root


def images(folders):
    return shards.open_dataset(folders / "images", "train", seed=1, return_keys=True,
                               decode=shards.Decode(decoder=key_decoder))


def features(folders):
    return shards.open_dataset(folders / "features", "train", seed=1)


LOADERS = [("images", WorkerProcesses(1, persistent=False)), ("images", InProcess()), ("images", Threads(2)),
           ("images", Auto(2, trial_batches=2, warmup_batches=0)), ("features", WorkerProcesses(1, persistent=False)),
           ("features", InProcess()), ("features", Threads(1))]


@pytest.mark.parametrize("kind,mode", LOADERS, ids=lambda v: str(v))
def test_every_loader_offers_quarantine_faults_and_stage_seconds(folders, kind, mode):
    dataset = images(folders) if kind == "images" else features(folders)
    loader = shards.make_loader(dataset, 4, mode=mode, drop_last=False)
    assert type(loader) is Loader and loader.mode == mode
    assert loader.quarantined == ()
    loader.report_faults(str(folders), None)  # no StallPolicy: nothing to report, and no error
    with pytest.raises(InputError, match="stack_dir"):
        loader.report_faults(str(folders / "nowhere"), None)  # checked in every mode
    assert sum(1 for _ in loader) == len(loader)
    seconds = loader.stage_seconds()
    assert set(seconds) == set(WORKER_STAGES) and seconds["read"] > 0
    loader.reset_stage_seconds()
    assert loader.stage_seconds() == dict.fromkeys(WORKER_STAGES, 0.0)


@pytest.mark.parametrize("kind", ["images", "features"])
def test_in_process_with_a_stall_policy_is_a_one_line_input_error(folders, kind):
    dataset = images(folders) if kind == "images" else features(folders)
    with pytest.raises(InputError, match=r"StallPolicy.*InProcess\(\)") as raised:
        shards.make_loader(dataset, 4, mode=InProcess(), stall=StallPolicy(5))
    assert "\n" not in str(raised.value)
    if kind == "features":  # the default mode of a feature dataset is in process: refused the same, not ignored
        with pytest.raises(InputError, match="StallPolicy"):
            shards.make_loader(dataset, 4, stall=StallPolicy(5))


def test_modes_are_frozen_values(folders):
    assert WorkerProcesses(2) == WorkerProcesses(2) and WorkerProcesses(2) != WorkerProcesses(3)
    assert InProcess() == InProcess() and hash(InProcess()) == hash(InProcess())
    assert len({WorkerProcesses(2), WorkerProcesses(2), InProcess()}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        WorkerProcesses(2).workers = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        InProcess().workers = 1
    for bad in (0, -1, 2.5, "2"):
        with pytest.raises(InputError, match="WorkerProcesses workers"):
            WorkerProcesses(bad)
    with pytest.raises(InputError, match="prefetch_factor"):
        WorkerProcesses(2, prefetch_factor=0)
    assert workers_mode(0) == InProcess() and workers_mode(3, persistent=False) == WorkerProcesses(3, persistent=False)
    with pytest.raises(InputError, match="mode must be a run mode"):
        shards.make_loader(features(folders), 4, mode=2)


@pytest.mark.parametrize("mode", [pytest.param(WorkerProcesses(1, persistent=True), marks=pytest.mark.slow),
                                  InProcess()], ids=str)
def test_the_quarantine_lives_in_the_cursor_and_survives_a_state_round_trip(folders, mode):
    dataset = images(folders)
    first = shards.make_loader(dataset, 4, mode=mode, drop_last=False)
    reference = [key for _, _, keys in first for key in keys]
    sample = first.batch_keys(0, 1)[1]
    row, key = sample["row"], sample["key"]
    other = shards.make_loader(dataset, 4, mode=mode, drop_last=False)  # the same dataset object
    other.load_state_dict({**other.state_dict(), "quarantined": [[row, key]]})
    assert other.quarantined == ((row, key),)
    assert first.quarantined == ()  # two loaders over one dataset share no quarantine
    assert not hasattr(dataset, "quarantine") and not hasattr(dataset, "quarantined")

    fed = [k for _, _, keys in other for k in keys]
    assert len(fed) == len(reference) and key not in fed  # its slot got a stand-in; every other slot as before
    assert [f for f, r in zip(fed, reference) if r != key] == [r for r in reference if r != key]
    assert [k for _, _, keys in first for k in keys] == reference  # the other loader still feeds it

    state = other.state_dict()
    assert state["quarantined"] == [[row, key]]
    resumed = shards.make_loader(images(folders), 4, mode=mode, drop_last=False)
    resumed.load_state_dict(state)
    assert resumed.quarantined == other.quarantined
    assert resumed.batch_keys(0, 1)[1] == {**sample, "stand_in": True}
    assert [k for _, _, keys in resumed for k in keys] == []  # saved after its last batch: the epoch is done
    for loader in (resumed, other):
        loader.set_epoch(1)  # kept out of every later epoch
    next_epoch = [k for _, _, keys in resumed for k in keys]
    assert key not in next_epoch and next_epoch == [k for _, _, keys in other for k in keys]
