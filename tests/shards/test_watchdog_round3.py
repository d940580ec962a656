"""The stall watchdog's own paths (issue 33): the restart cap counts restarts without progress, ``stack_dir`` is
checked when the loader is made, a hung decoder's child processes die with its worker, and ``--quiet`` keeps the
stack dumps out of stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shards.errors import InputError, ShardcacheError
from tests.helpers import make_shard_dataset
from tests.shards.test_stall_recovery import (
    FaultyDecoder, assert_fault_free_order, epoch_keys, hang_forever, key_decoder, open_loader,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("watchdog")
    make_shard_dataset(out, shard_sizes={"train": [12, 10, 14]}, size=(8, 8))
    return out


@pytest.fixture(scope="module")
def reference(data) -> list[str]:
    """The fault-free order of epoch 0 (36 samples, 9 batches of 4)."""
    return epoch_keys(open_loader(data, key_decoder))


class BadSamples:
    """Decodes a sample to its key, except on ``keys``: ``fault`` (``"hang"`` or ``"exit"``) every time."""

    def __init__(self, keys, fault: str):
        self.keys, self.fault = frozenset(keys), fault

    def __call__(self, sample, seed):
        if sample.key in self.keys:
            if self.fault == "hang":
                hang_forever()
            os._exit(1)
        return sample.key


class Everything(BadSamples):
    """A node where every decode kills the worker."""

    def __init__(self):
        super().__init__((), "exit")

    def __call__(self, sample, seed):
        os._exit(1)


# -- the cap counts restarts that made no progress -------------------------------------------------------------------
@pytest.mark.slow
def test_two_samples_that_kill_workers_are_both_quarantined_under_the_default_cap(data, reference):
    bad = {reference[6], reference[29]}
    events: list[dict] = []
    loader = open_loader(data, BadSamples(bad, "exit"), events=events, stall_timeout=30)
    keys = epoch_keys(loader)
    assert_fault_free_order(keys, reference, bad)
    assert {key for _, key in loader.quarantined} == bad
    assert sum(e["kind"] == "restart" for e in events) >= 4  # two faults per sample: more than max_restarts=3


@pytest.mark.slow
def test_five_samples_that_hang_the_decoder_are_each_quarantined_under_the_default_cap(data, reference):
    bad = {reference[i] for i in (5, 13, 19, 26, 34)}
    events: list[dict] = []
    loader = open_loader(data, BadSamples(bad, "hang"), events=events, stall_timeout=1)
    keys = epoch_keys(loader)
    assert_fault_free_order(keys, reference, bad)
    assert {key for _, key in loader.quarantined} == bad
    assert sum(e["kind"] == "quarantine" for e in events) == 5


@pytest.mark.slow
def test_a_node_that_fails_on_everything_still_stops_in_one_line(data):
    loader = open_loader(data, Everything(), stall_timeout=30)
    started = time.monotonic()
    with pytest.raises(ShardcacheError, match=r"restarted 4 times in epoch 0 \(max_restarts=3\)") as raised:
        epoch_keys(loader)
    assert "\n" not in str(raised.value)
    assert "no batch delivered and no sample quarantined" in str(raised.value)
    assert time.monotonic() - started < 60


# -- stack_dir is checked when the loader is made ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["missing", "file", "unwritable"])
def test_a_stack_dir_that_cannot_take_dumps_is_refused_when_the_loader_is_made(data, tmp_path, kind):
    if kind == "missing":
        stack_dir = tmp_path / "nowhere"
    elif kind == "file":
        stack_dir = tmp_path / "a-file"
        stack_dir.write_text("")
    else:
        stack_dir = Path("/proc")  # a folder no one, root included, can create a file in
    with pytest.raises(InputError, match="stack_dir") as raised:
        open_loader(data, key_decoder, stall_timeout=5, stack_dir=str(stack_dir))
    assert str(stack_dir) in str(raised.value) and "\n" not in str(raised.value)
    loader = open_loader(data, key_decoder, stall_timeout=5)
    with pytest.raises(InputError, match="stack_dir"):
        loader.report_faults(str(stack_dir), None)


# -- a hung decoder's children die with its worker ---------------------------------------------------------------
class SpawnsThenHangs:
    """On ``key``: start a ``sleep 1000`` child (its pid written to ``folder``), then hang."""

    def __init__(self, key: str, folder: str):
        self.key, self.folder = key, folder

    def __call__(self, sample, seed):
        if sample.key == self.key:
            child = subprocess.Popen(["sleep", "1000"])
            Path(self.folder, f"child-{child.pid}").write_text("")
            hang_forever()
        return sample.key


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting for its new parent to reap it is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_a_hung_decoders_child_processes_die_with_its_worker(data, reference, tmp_path):
    bad = reference[10]
    children = tmp_path / "children"
    children.mkdir()
    loader = open_loader(data, SpawnsThenHangs(bad, str(children)), stall_timeout=1)
    keys = epoch_keys(loader)
    assert_fault_free_order(keys, reference, {bad})
    pids = [int(path.name.split("-")[1]) for path in children.iterdir()]
    assert len(pids) == 2  # one per hang: the sample is quarantined after the second
    deadline = time.monotonic() + 5
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if running(pid)]
    for pid in left:
        os.kill(pid, 9)
    assert not left, "the decoder's child outlived the worker the watchdog killed"


# -- under --quiet the stacks go to the file only ------------------------------------------------------------------
QUIET_RUN = """
import sys
import shards
from shards.jobs.progress import setup_logging
from shards.loader.watchdog import StallPolicy
from shards.loader.worker_processes import WorkerProcesses
from tests.shards.test_stall_recovery import FaultyDecoder

data, bad, once, stacks = sys.argv[1:5]
setup_logging(quiet=True)  # what --quiet does
dataset = shards.open_dataset(data, "train", seed=3, decode=shards.Decode(decoder=FaultyDecoder(bad, "hang", once)),
                              errors=shards.ErrorPolicy("skip"))
loader = shards.make_loader(dataset, batch_size=4, mode=WorkerProcesses(2), drop_last=False, pin_memory=False,
                            stall=StallPolicy(1, stack_dir=stacks))
assert len([key for keys, _ in loader for key in keys]) == 36
"""


@pytest.mark.slow
def test_under_quiet_the_stack_dumps_go_to_the_file_only(data, reference, tmp_path):
    stacks, once = tmp_path / "stacks", tmp_path / "once"
    stacks.mkdir()
    once.mkdir()
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(QUIET_RUN), str(data), reference[9], str(once),
                           str(stacks)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    dumps = list(stacks.glob("worker-stacks-*.txt"))
    assert len(dumps) == 1 and "hang_forever" in dumps[0].read_text()
    assert "hang_forever" not in done.stderr and 'File "' not in done.stderr
    assert "stalled" in done.stderr and str(dumps[0]) in done.stderr  # one warning line names the file
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow  # over half a second in the quick loop
def test_without_quiet_the_stacks_are_logged_at_info(data, reference, tmp_path, caplog):
    events: list[dict] = []
    loader = open_loader(data, FaultyDecoder(reference[9], "exit", once_dir=str(tmp_path)), events=events,
                         stall_timeout=30)
    with caplog.at_level("INFO", logger="shards.loader.watchdog"):
        epoch_keys(loader)
    assert [e["kind"] for e in events] == ["restart"]
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "\n" not in warnings[0].getMessage()
    assert any(r.levelname == "INFO" and "## worker" in r.getMessage() for r in caplog.records)


# -- leaving an epoch early prints nothing at interpreter exit -------------------------------------------------------
EARLY_EXIT = """
import sys
import shards
from shards.loader.watchdog import StallPolicy
from shards.loader.worker_processes import WorkerProcesses
from tests.shards.test_stall_recovery import key_decoder

kept = []
for stall_timeout in (None, 30):
    dataset = shards.open_dataset(sys.argv[1], "train", seed=3, decode=shards.Decode(decoder=key_decoder))
    loader = shards.make_loader(dataset, batch_size=4, mode=WorkerProcesses(2), drop_last=False, pin_memory=False,
                                stall=None if stall_timeout is None else StallPolicy(stall_timeout))
    batches = iter(loader)
    for step, batch in enumerate(batches):
        if step == 2:
            break  # mid-epoch, workers running; the iterator lives on until the interpreter exits
    kept.append(batches)
"""


@pytest.mark.slow
def test_leaving_an_epoch_early_prints_nothing_at_interpreter_exit(data):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(EARLY_EXIT), str(data)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert done.stderr == ""
