"""Stall and crash recovery (``make_loader(stall=StallPolicy(...))``, ``shards.loader.watchdog``): real worker processes
that hang, exit, are killed or stopped; every epoch still yields the fault-free order, less quarantined samples."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

import shards
from shards.errors import CorruptDataError, ShardcacheError
from shards.loader.watchdog import StallPolicy
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset

BATCH = 4
WORKERS = 2


def hang_forever() -> None:
    while True:
        time.sleep(60)


class FaultyDecoder:
    """Decodes a sample to its key, except on ``key``: ``fault`` it, every time or (``once_dir``) only the first
    time across all worker processes (a marker file remembers)."""

    def __init__(self, key: str, fault: str, once_dir: str | None = None):
        self.key, self.fault, self.once_dir = key, fault, once_dir

    def __call__(self, sample, seed):
        if sample.key == self.key and self._first_time():
            if self.fault == "hang":
                hang_forever()
            elif self.fault == "exit":
                os._exit(1)
            else:
                os.kill(os.getpid(), getattr(signal, self.fault))
        return sample.key

    def _first_time(self) -> bool:
        if self.once_dir is None:
            return True
        try:
            (Path(self.once_dir) / "faulted").open("x").close()
            return True
        except FileExistsError:
            return False


def key_decoder(sample, seed):
    return sample.key


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stall")
    make_shard_dataset(out, shard_sizes={"train": [12, 10, 14]}, size=(8, 8))
    return out


def open_loader(folder: Path, decoder, *, on_error: str = "skip", events: list | None = None,
                stall_timeout: float | None = None, **stall_options):
    """``WORKERS`` worker processes; with ``stall_timeout``, a ``StallPolicy`` of it and ``stall_options``."""
    dataset = shards.open_dataset(folder, "train", seed=3, decode=shards.Decode(decoder=decoder),
                                  errors=shards.ErrorPolicy(on_error))
    stall = None if stall_timeout is None else StallPolicy(
        stall_timeout, on_event=None if events is None else events.append, **stall_options)
    return shards.make_loader(dataset, batch_size=BATCH, mode=WorkerProcesses(WORKERS), stall=stall, drop_last=False,
                              pin_memory=False)


def epoch_keys(loader, epoch: int = 0) -> list[str]:
    loader.set_epoch(epoch)
    return [key for keys, _ in loader for key in keys]


@pytest.fixture(scope="module")
def reference(data) -> list[str]:
    """The fault-free order of epoch 0."""
    return epoch_keys(open_loader(data, key_decoder))


def assert_fault_free_order(keys: list[str], reference: list[str], quarantined: set[str] = frozenset()) -> None:
    """Same length, same keys in the same slots, except a quarantined key's slots hold a stand-in."""
    assert len(keys) == len(reference)
    for got, expected in zip(keys, reference):
        if expected in quarantined:
            assert got not in quarantined and got in reference
        else:
            assert got == expected
    assert not quarantined & set(keys)


@pytest.mark.slow
def test_a_decoder_that_exits_twice_quarantines_its_sample(data, reference, tmp_path):
    bad = reference[9]
    events: list[dict] = []
    loader = open_loader(data, FaultyDecoder(bad, "exit"), events=events, stall_timeout=5, stack_dir=str(tmp_path))
    keys = epoch_keys(loader)
    assert_fault_free_order(keys, reference, {bad})
    assert [key for _, key in loader.quarantined] == [bad]
    restarts = [e for e in events if e["kind"] == "restart"]
    assert [e["reason"] for e in restarts] == ["exit 1", "exit 1"]
    assert all((tmp_path / e["stacks"]).is_file() for e in restarts)
    quarantine = [e for e in events if e["kind"] == "quarantine"]
    assert [(e["key"], e["reason"], e["row"]) for e in quarantine] == [(bad, "exit 1", loader.quarantined[0][0])]
    assert quarantine[0]["shard"].endswith(".tar")
    assert f"[sample {bad}]" in (tmp_path / restarts[0]["stacks"]).read_text()
    # The next epoch keeps it out (no restart needed), and so does a loader resumed from the state.
    assert bad not in epoch_keys(loader, 1)
    state = loader.state_dict()
    assert state["quarantined"] == [[loader.quarantined[0][0], bad]]
    assert open_loader(data, key_decoder).state_dict()["quarantined"] is None  # none: nothing recorded


@pytest.mark.slow
def test_a_resumed_loader_keeps_the_quarantined_sample_out(data, reference):
    bad = reference[5]
    loader = open_loader(data, FaultyDecoder(bad, "exit"), stall_timeout=5)
    loader.set_epoch(0)
    batches = iter(loader)
    for _ in range(3):  # past the quarantine (batch 1 holds the bad sample)
        next(batches)
    state = loader.state_dict(batches_consumed=1)
    resumed = open_loader(data, key_decoder)  # a decoder that would not fail: only the quarantine keeps it out
    resumed.load_state_dict(state)
    assert resumed.quarantined == loader.quarantined
    keys = [key for keys, _ in resumed for key in keys]
    assert_fault_free_order(keys, reference[BATCH:], {bad})


def test_restarts_beyond_the_cap_are_an_error(data, reference):
    loader = open_loader(data, FaultyDecoder(reference[2], "exit"), stall_timeout=5, max_restarts=0)
    with pytest.raises(ShardcacheError, match=r"restarted 1 times in epoch 0 \(max_restarts=0\); last: exit 1"):
        epoch_keys(loader)


@pytest.mark.slow  # kills and restarts worker processes
def test_a_worker_killed_once_is_restarted_and_the_epoch_is_whole(data, reference, tmp_path):
    events: list[dict] = []
    loader = open_loader(data, FaultyDecoder(reference[13], "SIGKILL", once_dir=str(tmp_path)), events=events,
                         stall_timeout=5)
    assert epoch_keys(loader) == reference
    assert [e["reason"] for e in events] == ["signal SIGKILL"]
    assert loader.quarantined == ()


@pytest.mark.slow
def test_a_decoder_that_hangs_is_dumped_restarted_and_quarantined(data, reference, tmp_path):
    bad = reference[17]
    events: list[dict] = []
    loader = open_loader(data, FaultyDecoder(bad, "hang"), events=events, stall_timeout=1, stack_dir=str(tmp_path))
    started = time.monotonic()
    keys = epoch_keys(loader)
    elapsed = time.monotonic() - started
    assert_fault_free_order(keys, reference, {bad})
    assert [key for _, key in loader.quarantined] == [bad]
    assert [e["kind"] for e in events] == ["restart", "restart", "quarantine"]
    assert events[2]["reason"] == "stall"
    dump = (tmp_path / events[0]["stacks"]).read_text()
    assert "hang_forever" in dump and f"[sample {bad}]" in dump
    assert elapsed < 3 * 1 + 10  # two stalls, their dumps and restarts, and the epoch itself


@pytest.mark.slow
def test_a_stopped_worker_is_killed_and_the_epoch_is_whole(data, reference, tmp_path):
    events: list[dict] = []
    loader = open_loader(data, FaultyDecoder(reference[6], "SIGSTOP", once_dir=str(tmp_path)), events=events,
                         stall_timeout=1, stack_dir=str(tmp_path))
    assert epoch_keys(loader) == reference
    assert [e["kind"] for e in events] == ["restart"]
    assert "stopped" in (tmp_path / events[0]["stacks"]).read_text()


@pytest.mark.slow
def test_with_on_error_raise_a_stall_is_one_line_naming_key_and_frame(data, reference):
    bad = reference[3]
    loader = open_loader(data, FaultyDecoder(bad, "hang"), on_error="raise", stall_timeout=1)
    with pytest.raises(CorruptDataError) as raised:
        epoch_keys(loader)
    message = str(raised.value)
    assert "\n" not in message
    assert f"[sample {bad}]" in message and "hang_forever" in message and ".tar" in message


@pytest.mark.slow  # two loaders' worker processes over three epochs
def test_persistent_workers_with_batches_in_ring_slots_run_every_epoch(tmp_path):
    """Batches large enough for the reused slots (``shards.procs.slabs``) come through a per-epoch wrapper; the
    watchdog's hook on the persistent iterator outlives it, and the next epoch's start called the hook through a
    proxy of the gone wrapper (ReferenceError at epoch 2)."""
    root = tmp_path / "big"
    make_shard_dataset(root, shard_sizes={"train": [8, 8]}, size=(64, 64))
    dataset = shards.open_dataset(root, "train", transform=shards.TransformSpec(preset="eval", size=64), seed=0)
    plain = shards.make_loader(dataset, 8, num_workers=WORKERS, drop_last=False)
    watched = shards.make_loader(dataset, 8, num_workers=WORKERS, drop_last=False, stall=StallPolicy(60))
    for epoch in range(3):
        dataset.set_epoch(epoch)
        expected = [labels.tolist() for _, labels in plain]
        got = [labels.tolist() for _, labels in watched]
        assert got == expected and sum(map(len, got)) == 16
    assert watched.run.ring is not None  # the batches did go through the ring


@pytest.mark.slow  # a worker that exits, restarted twice
def test_without_a_stack_dir_the_named_dump_outlives_the_loader(data, reference, caplog):
    """The dumps a warning or an error names went to the loader's own temp folder, removed with the loader: a
    script that failed on a stall pointed at a file gone by the time anyone looked."""
    bad = reference[9]
    loader = open_loader(data, FaultyDecoder(bad, "exit"), events=[], stall_timeout=5)
    with caplog.at_level("WARNING", logger="shards.loader.watchdog"):
        epoch_keys(loader)
    named = [line.rsplit("stacks in ", 1)[1] for line in caplog.messages if "stacks in " in line]
    assert named, caplog.messages
    del loader
    import gc

    gc.collect()
    try:
        assert all(Path(path).is_file() and f"[sample {bad}]" in Path(path).read_text() for path in named)
    finally:
        for path in named:
            Path(path).unlink(missing_ok=True)
