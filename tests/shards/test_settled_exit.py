"""Once a command's outcome is decided and said (its JSON printed, or its one error line), a stop signal during the
interpreter's teardown ends the process with that outcome's code: it ended as killed by SIGTERM (143) about 1.7 s
after train-from-shards had printed its result, which a requeue script reads as a failure."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import atexit, os, signal, sys, time
sys.path.insert(0, {root!r})
from shards.cli.exits import settle, settle_on_signal

def teardown():  # what torch's teardown gives a scheduler time for: a signal arrives meanwhile
    os.kill(os.getpid(), signal.{sig})
    time.sleep(0.2)

atexit.register(teardown)
print("result")
from shards.cli import exits
exits._ENTRY.append(True)  # as a console script runs
if sys.argv[1] == "done":
    settle_on_signal()
else:
    settle(int(sys.argv[1]))
"""


@pytest.mark.parametrize("outcome,code", [("done", 0), ("75", 75), ("2", 2)])
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGINT"])
def test_a_stop_signal_after_the_outcome_exits_with_its_code(outcome, code, sig):
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT), sig=sig), outcome],
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (code, "result\n")


def test_a_command_invoked_in_a_process_that_goes_on_leaves_its_signal_handlers_alone(tmp_path):
    import signal

    from click.testing import CliRunner

    from preprocess.pack.cli import pack_shards_command

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    result = CliRunner().invoke(pack_shards_command, [str(tmp_path / "missing"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert {sig: signal.getsignal(sig) for sig in before} == before  # handlers go in only at the exit
