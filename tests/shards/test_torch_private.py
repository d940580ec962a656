"""Torch's private DataLoader names, pinned against the installed torch (``shards.procs.torch_private``).

Each adapter call is exercised on a real multi-process iterator: the attribute exists and behaves as the watchdog
and the worker-process run use it. A torch upgrade that renames one fails here, by name."""

import multiprocessing
import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from shards.procs import torch_private


class Numbers(IterableDataset):
    def __init__(self, count: int):
        self.count = count

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        yield from range(worker, self.count, workers)


@pytest.fixture
def iterator():
    loader = DataLoader(Numbers(8), batch_size=2, num_workers=2, multiprocessing_context="fork")
    iterator = iter(loader)
    yield iterator
    torch_private.shutdown_workers(iterator)


def test_worker_processes_and_their_status(iterator):
    processes = torch_private.worker_processes(iterator)
    assert len(processes) == 2
    assert all(isinstance(p, multiprocessing.process.BaseProcess) and p.is_alive() for p in processes)
    assert torch_private.workers_expected(iterator) == [True, True]


def test_the_awaited_batch_and_its_worker(iterator):
    assert torch_private.awaited_index(iterator) == 0
    assert torch_private.awaited_workers(iterator) == [0]  # batch 0 went to worker 0
    assert torch.equal(next(iterator), torch.tensor([0, 2]))
    assert torch_private.awaited_index(iterator) == 1
    assert torch_private.awaited_workers(iterator) == [1]


def test_try_get_data_waits_for_one_item(iterator):
    got, data = False, None
    for _ in range(600):  # the workers are starting: up to a minute
        got, data = torch_private.try_get_data(iterator, 0.1)
        if got:
            break
    assert got
    index, batch = data  # torch's own (index, batch) pair, which its ``_get_data`` hands ``_process_data``
    assert isinstance(index, int) and torch.is_tensor(batch)


def test_replace_get_data_is_what_next_calls(iterator):
    calls = []
    original = iterator._get_data

    def get_data():
        calls.append(1)
        return original()

    torch_private.replace_get_data(iterator, get_data)
    assert torch.equal(next(iterator), torch.tensor([0, 2]))
    assert calls


def test_release_sigchld_takes_the_pids_out_of_torchs_handler(iterator):
    assert iterator._worker_pids_set
    torch_private.release_sigchld(iterator)
    assert not iterator._worker_pids_set
    torch_private.release_sigchld(iterator)  # twice: nothing left to release
    # A worker killed now is ours to notice, not an error torch raises in the main thread.
    process = torch_private.worker_processes(iterator)[1]
    os.kill(process.pid, signal.SIGKILL)
    process.join(timeout=10)
    assert process.exitcode == -signal.SIGKILL


def test_pin_thread_dead_without_pinning(iterator):
    assert torch_private.pin_thread_dead(iterator) is False


def test_shutdown_workers_stops_them(iterator):
    processes = torch_private.worker_processes(iterator)
    assert not torch_private.workers_stopped(iterator)
    torch_private.shutdown_workers(iterator)
    assert not any(p.is_alive() for p in processes)
    assert torch_private.workers_stopped(iterator)
    torch_private.shutdown_workers(iter(DataLoader(Numbers(2))))  # a single-process iterator: nothing to stop


def test_forget_persistent_iterator_starts_fresh_workers():
    loader = DataLoader(Numbers(4), batch_size=2, num_workers=1, persistent_workers=True,
                        multiprocessing_context="fork")
    first = iter(loader)
    assert iter(loader) is first  # persistent: the same iterator, reset
    torch_private.forget_persistent_iterator(loader)
    second = iter(loader)
    try:
        assert second is not first
    finally:
        torch_private.shutdown_workers(first)
        torch_private.shutdown_workers(second)


def test_collate_and_pinning_helpers():
    batch = torch_private.default_collate([torch.tensor([1]), torch.tensor([2])])
    assert torch.equal(batch, torch.tensor([[1], [2]]))
    assert torch.equal(torch_private.collate([torch.tensor(3), torch.tensor(4)],
                                             collate_fn_map=torch_private.default_collate_fn_map), torch.tensor([3, 4]))
    # Walks nested containers as the loaders pass them (no tensor here: pinning needs an accelerator).
    assert torch_private.pin_nested({"key": ["a", 3]}, None) == {"key": ["a", 3]}
