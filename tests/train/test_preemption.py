"""Preemption keeps the place: a stop signal during train-from-shards finishes the step in flight, saves the exact
position in last.pt, says where --resume starts and exits 75; the resumed run feeds, step for step, the keys an
uninterrupted run feeds (one process with worker processes or threads, and two ranks under torchrun)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shards.cli.common import EXIT_PREEMPTED
from shards.jobs.preemption import Preempted, StopRequest, stop_signals
from shards.errors import InputError
from tests.stop_requests import StopAfter
from tests.train.conftest import write_feature_folder
from tests.train.configs import train_config
from train.distributed import DistContext
from train.run.checkpoint import load_checkpoint
from train.run.lineage import read_recorded_keys
from train.run.loop import train
from train.run.preempt import StopVote

TIMEOUT_S = 240
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ONE_PROCESS = DistContext(0, 1, 0, torch.device("cpu"), owns_group=False)


def test_stop_signals_set_the_request_and_put_the_previous_handlers_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    with stop_signals("a test") as stop:
        assert not stop
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal changes nothing: the first one names the stop
        assert stop and stop.signal_name == "SIGUSR1"
        with pytest.raises(KeyboardInterrupt):  # but a second Ctrl-C is the impatient "out now"
            os.kill(os.getpid(), signal.SIGINT)
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_one_process_stops_after_the_step_it_was_signalled_in():
    stop = StopRequest()
    vote = StopVote(stop, ONE_PROCESS)
    assert vote.group is None and not vote.poll() and not vote.agree()
    stop.request(signal.SIGINT)
    assert vote.poll() and vote.agree() and vote.signal_name() == "SIGINT"
    assert StopVote(None, ONE_PROCESS).poll() is False  # a Python caller without the CLI's handlers


def run_config(folder: Path, out: Path, **fields):
    return train_config(folder, out, epochs=2, batch_size=16, workers=0, device="cpu", quiet=True, record_keys=True,
                        head="mlp", hidden_dim=32, dropout=0.3, **fields)


def assert_same_run(whole: Path, resumed: Path) -> None:
    """Every step fed the same keys (a step trained twice: its last line), and the same weights came out."""
    expected, got = read_recorded_keys(whole), read_recorded_keys(resumed)
    assert sorted(got) == sorted(expected)
    assert all(got[at] == expected[at] for at in expected), [at for at in expected if got[at] != expected[at]]
    weights = torch.load(whole / "model.pt", weights_only=True)["state_dict"]
    again = torch.load(resumed / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(tensor, again[name]) for name, tensor in weights.items())


@pytest.mark.slow
def test_a_signal_mid_epoch_saves_the_exact_place_and_the_resume_feeds_what_an_uninterrupted_run_does(
        feature_folder: Path, tmp_path: Path):
    # 161 train samples, batches of 16: 10 steps an epoch; no --checkpoint-every, the default.
    train(run_config(feature_folder, tmp_path / "whole"))
    run = tmp_path / "run"
    with pytest.raises(Preempted) as stopped:
        train(run_config(feature_folder, run), stop=StopAfter(13))  # steps 1-10, epoch 1's end, steps 11-12
    assert stopped.value.line == (f"stopped by SIGTERM: saved {run / 'last.pt'}; --resume starts at epoch 2, "
                                  f"batch 3 of 10 (step 13; 32 samples of the epoch done)")
    saved = load_checkpoint(run / "last.pt")
    assert saved["train_state"]["step"] == 12 and saved["loader"] is not None
    assert max(step for _, step, _ in read_recorded_keys(run)) == 12  # no batch drawn after the step in flight
    train(run_config(feature_folder, run, resume=True))
    assert_same_run(tmp_path / "whole", run)


@pytest.mark.slow
def test_a_signal_in_an_epochs_last_step_stops_after_that_epoch_ends(feature_folder: Path, tmp_path: Path):
    train(run_config(feature_folder, tmp_path / "whole"))
    run = tmp_path / "run"
    with pytest.raises(Preempted, match=r"starts at the start of epoch 2 \(step 11\)"):
        train(run_config(feature_folder, run), stop=StopAfter(10))
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1  # validated and recorded before stopping
    assert load_checkpoint(run / "last.pt")["loader"] is None
    train(run_config(feature_folder, run, resume=True))
    assert_same_run(tmp_path / "whole", run)


# -- the command, signalled from outside as a user or a scheduler does --------------------------------------------

def command(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "train", str(data), "--out", str(out), "--epochs", "2", "--batch-size", "4",
            "--image-size", "32", "--optimizer", "adamw", "--device", "cpu", "--quiet", "--record-keys", *extra]


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux /proc), as Slurm's cgroup would signal them all."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def signalled_at(cmd: list[str], keys_file: Path, step: int, sig: int, *, whole_tree: bool,
                 pick=lambda process: [process.pid]) -> subprocess.CompletedProcess:
    """Run ``cmd``; once it has been handed the batch of ``step``, send ``sig`` to the processes ``pick`` names
    (and every process below the command when ``whole_tree``); return the finished process."""
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV, text=True)
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if keys_file.exists() and any(json.loads(line)["step"] >= step
                                      for line in keys_file.read_text().splitlines() if line.endswith("}")):
            break
        assert process.poll() is None, process.stderr.read()[-3000:]
        time.sleep(0.01)
    targets = pick(process) + (descendants(process.pid) if whole_tree else [])
    for pid in targets:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    out, err = process.communicate(timeout=TIMEOUT_S)
    return subprocess.CompletedProcess(cmd, process.returncode, out, err)


@pytest.mark.slow
@pytest.mark.parametrize("mode, sig", [("processes", signal.SIGTERM), ("threads", signal.SIGUSR1)])
def test_the_command_signalled_exits_75_and_resumes_step_for_step(image_folder: Path, tmp_path: Path, mode, sig):
    options = ("--workers", "2", "--run-mode", mode)
    whole = subprocess.run(command(image_folder, tmp_path / "whole", *options), capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=ENV)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run = tmp_path / "run"
    # Every process of the command gets it, the workers too, as Slurm signals a whole job step.
    stopped = signalled_at(command(image_folder, run, *options), run / "keys.jsonl", 5, sig, whole_tree=True)
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    line = stopped.stderr.strip().splitlines()[-1]
    assert line.startswith(f"stopped by {signal.Signals(sig).name}: saved {run / 'last.pt'}; --resume starts at")
    assert "Traceback" not in stopped.stderr and stopped.stdout == ""
    resumed = subprocess.run(command(image_folder, run, *options, "--resume"), capture_output=True, text=True,
                             timeout=TIMEOUT_S, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "whole", run)


def torchrun(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "train",
            str(data), "--out", str(out), "--epochs", "2", "--batch-size", "8", "--device", "cpu", "--quiet",
            "--record-keys", *extra]


def rank_zero(process: subprocess.Popen) -> list[int]:
    """The training process of rank 0 (its environment says RANK=0)."""
    for pid in descendants(process.pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"RANK=0" in environ and b"LOCAL_RANK=0" in environ:
            return [pid]
    raise AssertionError("no rank 0 process found")


@pytest.mark.slow
def test_two_ranks_stop_together_when_rank_0_alone_is_signalled_and_resume_step_for_step(feature_folder: Path,
                                                                                        tmp_path: Path):
    whole = subprocess.run(torchrun(feature_folder, tmp_path / "whole"), capture_output=True, text=True,
                           timeout=TIMEOUT_S, env=ENV)
    assert whole.returncode == 0, whole.stderr[-3000:]
    run = tmp_path / "run"
    stopped = signalled_at(torchrun(feature_folder, run), run / "keys.jsonl", 6, signal.SIGTERM, whole_tree=False,
                           pick=rank_zero)
    # torchrun reports its workers' failure as 1; both ranks exited 75 after rank 0 had saved.
    assert stopped.returncode != 0 and "stopped by SIGTERM: saved" in stopped.stderr, stopped.stderr[-3000:]
    assert stopped.stderr.count("stopped by SIGTERM") == 1  # rank 0 speaks
    assert "exitcode: 75" in stopped.stderr or "exit code: 75" in stopped.stderr, stopped.stderr[-3000:]
    saved = load_checkpoint(run / "last.pt")["train_state"]["step"]
    recorded = read_recorded_keys(run)
    assert {step for _, step, rank in recorded if rank == 1} == {step for _, step, rank in recorded if rank == 0}
    assert max(step for _, step, _ in recorded) == saved  # both ranks stopped after the step that was saved
    resumed = subprocess.run(torchrun(feature_folder, run, "--resume"), capture_output=True, text=True,
                             timeout=TIMEOUT_S, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path / "whole", run)


@pytest.mark.slow
def test_a_resume_over_features_recomputed_since_is_refused(tmp_path: Path):
    """Epochs before the stop on one set of features, the rest on another, and nothing said: the run records what
    it trains on (``data_identity`` in each checkpoint) and a resume over other features is one line, exit 2."""
    folder = write_feature_folder(tmp_path / "cache", shard_sizes={"train": [70, 45, 29, 17], "val": [37, 24]},
                                  classes=("ant", "bee", "cat", "dog"))
    run = tmp_path / "run"
    with pytest.raises(Preempted):
        train(run_config(folder, run), stop=StopAfter(13))
    write_feature_folder(tmp_path / "cache", shard_sizes={"train": [70, 45, 29, 17], "val": [37, 24]},
                         classes=("ant", "bee", "cat", "dog"), seed=1)  # recomputed: other numbers, same keys
    with pytest.raises(InputError, match=r"--resume: .*last.pt was trained on other data than .* holds now") as caught:
        train(run_config(folder, run, resume=True))
    assert "\n" not in str(caught.value)


@pytest.mark.slow
def test_a_resume_over_the_same_features_goes_on(feature_folder: Path, tmp_path: Path):
    run = tmp_path / "run"
    with pytest.raises(Preempted):
        train(run_config(feature_folder, run), stop=StopAfter(5))
    assert load_checkpoint(run / "last.pt")["data_identity"]
    train(run_config(feature_folder, run, resume=True))
    assert (run / "model.pt").is_file()
