"""``pid_alive``: the one answer to "is this process still there" (stale cache stamps, the orphaned-worker guard)."""

from __future__ import annotations

import os
import subprocess
import sys

from shards.lock import pid_alive


def test_this_process_is_alive():
    assert pid_alive(os.getpid())


def test_an_exited_and_reaped_child_is_not():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)


def test_zero_and_negative_pids_are_not_processes():
    # kill(0, ...) and kill(-n, ...) address process groups, which always "exist" for the caller
    assert not pid_alive(0)
    assert not pid_alive(-1)
    assert not pid_alive(-os.getpgrp())


def test_a_process_of_another_user_counts_as_alive():
    # pid 1 always exists; unless we are root, signalling it is refused (EPERM), which still means alive
    assert pid_alive(1)
