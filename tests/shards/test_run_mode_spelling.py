"""The run mode's one spelling (``shards.loader.loader``): ``RunMode.parse`` reads the CLI's text, the JSON form and a
bare worker count into the same value, ``to_json`` round-trips, an option name means one thing in every mode, old
keywords are refused naming the new ones, the run record keeps the JSON form (and reads an older bare count), and each
mode builds its own supervision."""

from __future__ import annotations

import pytest

import shards
from shards.errors import InputError, ManifestError
from shards.loader.auto import Auto
from shards.loader.base import RunMode
from shards.loader.in_process import InProcess
from shards.loader.threads import Threads
from shards.loader.watchdog import StallPolicy, Watchdog
from shards.loader.worker_processes import WorkerProcesses
from shards.runrecord import DataCall, LoaderCall
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset

MODES = [InProcess(), WorkerProcesses(3), WorkerProcesses(2, prefetch=1, persistent=False, decoders=4), Threads(2),
         Threads(4, decoders=2, prefetch=3), Auto(2), Auto(3, trial_batches=4, warmup_batches=0)]


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_the_json_form_reads_back_to_the_same_mode(mode):
    record = mode.to_json()
    assert record["kind"] == mode.kind and RunMode.parse(record) == mode
    assert RunMode.parse(mode) is mode


@pytest.mark.parametrize("text,mode", [
    ("0", InProcess()), ("3", WorkerProcesses(3)), ("in-process", InProcess()), ("processes:2", WorkerProcesses(2)),
    ("processes:2,prefetch=1,persistent=false,decoders=4", WorkerProcesses(2, prefetch=1, persistent=False,
                                                                           decoders=4)),
    ("threads:4, decoders=2, prefetch=3", Threads(4, decoders=2, prefetch=3)), ("auto:3", Auto(3)),
])
def test_the_text_form_and_a_bare_count_are_the_same_values(text, mode):
    assert RunMode.parse(text) == mode
    if text.isdigit():
        assert RunMode.parse(int(text)) == mode  # an older run record's bare worker count


def test_the_same_option_means_the_same_in_every_mode():
    assert WorkerProcesses(2, prefetch=3).batches_ahead == 6 and Threads(2, prefetch=3).batches_ahead == 8
    for mode in (WorkerProcesses(2, decoders=3), Threads(2, decoders=3)):
        assert mode.decoders == 3 and "decoders" in mode.to_json()


@pytest.mark.parametrize("value,message", [
    ({"kind": "processes", "workers": 2, "threads": 2}, "decode threads are decoders= in every run mode"),
    ("processes:2,prefetch_factor=3", "prefetch= in every run mode"),
    ("thread:2", "is not one of processes, threads, in-process, auto"),
    ({"kind": "in-process", "workers": 2}, "has no option 'workers': it takes no options"),
    ("processes:two", "is not a worker count"), ("threads:2,decoders", "is not NAME=VALUE"),
    ("processes:2,decoders=1", "decoders must be 0"), (-1, "must be >= 0"), (2.0, "is not a run mode"),
    (True, "is not a run mode"),
])
def test_a_misspelt_mode_is_one_line_naming_our_spelling(value, message):
    with pytest.raises(InputError, match=message) as raised:
        RunMode.parse(value)
    assert "\n" not in str(raised.value)


def test_the_old_keywords_are_refused_with_the_new_ones():
    with pytest.raises(InputError, match=r"WorkerProcesses\(threads=2\): decode threads are decoders="):
        WorkerProcesses(2, threads=2)
    with pytest.raises(InputError, match=r"WorkerProcesses\(prefetch_factor=1\): .* prefetch="):
        WorkerProcesses(2, prefetch_factor=1)


def call(make_loader: dict) -> dict:
    opened = {"path": "/data", "sources": None, "split": "train", "seed": 0, "return_keys": False, "sampling": {},
              "decode": {}, "remote": {}, "distributed": {}, "mix": {}}
    return {"open_dataset": opened, "make_loader": make_loader}


def test_the_run_record_keeps_the_json_form_and_reads_an_older_bare_count():
    recorded = DataCall.of("/data", "train", transform=None, seed=0, return_keys=False, sampling=shards.Sampling(),
                           decode=shards.Decode(), remote=shards.Remote(), distributed=shards.Distributed(),
                           mix=shards.MixOptions(), loader=LoaderCall(8, drop_last=True, mode=Threads(2, decoders=2)))
    assert recorded.make_loader["mode"] == {"kind": "threads", "workers": 2, "decoders": 2, "prefetch": 2}
    again = DataCall.from_json(recorded.to_json(), "run.json")
    assert RunMode.parse(again.run_mode) == Threads(2, decoders=2)
    older = DataCall.from_json(call({"batch_size": 8, "drop_last": True, "workers": 3}), "run.json")
    assert RunMode.parse(older.run_mode) == WorkerProcesses(3)
    for loader, message in (({"batch_size": 8, "drop_last": True}, "neither a run mode nor a worker count"),
                            ({"batch_size": 8, "drop_last": True, "workers": 1, "mode": {"kind": "auto"}}, "or both"),
                            ({"batch_size": 8, "drop_last": True, "mode": {"workers": 2}}, "kind")):
        with pytest.raises(ManifestError, match=message):
            DataCall.from_json(call(loader), "run.json")


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("spelling")
    make_shard_dataset(root / "images", shard_sizes={"train": [5, 4]}, size=(8, 8))
    write_feature_dataset(root / "features", [6, 5])
    return (shards.open_dataset(root / "images", "train", decode=shards.Decode(decoder=lambda sample, seed: 0)),
            shards.open_dataset(root / "features", "train"))


def test_each_mode_builds_its_own_supervision(datasets):
    images, features = datasets
    stall = StallPolicy(30.0)
    assert isinstance(shards.make_loader(images, 4, mode=WorkerProcesses(1), stall=stall).watchdog, Watchdog)
    assert isinstance(shards.make_loader(images, 4, mode=Auto(1), stall=stall).watchdog, Watchdog)
    assert shards.make_loader(images, 4, mode=Threads(1), stall=stall).watchdog is None  # the run raises itself
    assert shards.make_loader(images, 4, mode=WorkerProcesses(1)).watchdog is None
    with pytest.raises(InputError, match="StallPolicy.*runs none"):
        shards.make_loader(features, 4, mode=InProcess(), stall=stall)


def test_in_process_asks_the_dataset_how_its_rows_are_read(datasets):
    images, features = datasets
    assert InProcess().layout(features, 4) == ("feature_batches", 1) and InProcess().layout(images, 4)[1] == 4
    assert shards.make_loader(features, 4).mode == InProcess() == shards.make_loader(features, 4, mode="auto").mode
    assert shards.make_loader(images, 4, mode="auto:2").mode == Auto(2)
