"""Worker processes fit their batches to the space /dev/shm has (``shards.procs.shm``): a shallower prefetch, or
the pipe when not one batch per worker fits; the same batches either way, and an epoch that completes on a real
64 MB tmpfs over /dev/shm."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import shards
from shards.loader import worker_processes
from shards.loader.budget import sample_bytes
from shards.procs.shm import Piped, PipedCollate, plan_handoff, received, shm_free
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset
from tests.shards.budget_helpers import label_decoder, write_small_dataset

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def test_plan_keeps_the_prefetch_that_fits():
    assert plan_handoff(1 << 30, 10 * MIB, 2, 4).prefetch_factor == 4
    assert plan_handoff(1 << 30, 10 * MIB, 2, 4).note is None
    assert plan_handoff(None, 10 * MIB, 2, 4).prefetch_factor == 4  # not measurable: as asked


def test_plan_shallows_the_prefetch_then_pipes():
    shallow = plan_handoff(64 * MIB, 9 * MIB, 2, 4)
    assert (shallow.prefetch_factor, shallow.piped) == (1, False) and "1 batch(es) ahead" in shallow.note
    assert (shallow.prefetch_factor * 2 + 2) * 9 * MIB <= 64 * MIB
    piped = plan_handoff(64 * MIB, 70 * MIB, 2, 4)
    assert piped.piped and piped.prefetch_factor == 1 and "pipe" in piped.note and "\n" not in piped.note


def test_shm_free_measures_a_folder_and_none_for_a_missing_one(tmp_path):
    assert shm_free(tmp_path) > 0
    assert shm_free(tmp_path / "missing") is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.int64])
def test_a_piped_tensor_is_the_same_tensor(dtype):
    tensor = (torch.arange(24).reshape(2, 3, 4) % 3).to(dtype)
    back = Piped.of(tensor).tensor()
    assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_piped_collate_makes_no_tensor_and_received_restores_the_batch():
    samples = [(torch.full((3, 2), float(i)), i) for i in range(4)]
    piped = PipedCollate(torch.utils.data.default_collate)(samples)
    assert not any(isinstance(part, torch.Tensor) for part in piped)
    images, labels = received(piped, pin=False)
    assert torch.equal(images, torch.stack([s[0] for s in samples])) and labels.tolist() == [0, 1, 2, 3]
    assert sample_bytes(samples[0]) == 3 * 2 * 4 + 8


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return write_small_dataset(tmp_path_factory.mktemp("shm"))


@pytest.mark.slow
@pytest.mark.parametrize("free", [6_000, 700])  # bytes: a shallower prefetch; not even one batch: the pipe
def test_a_small_shm_feeds_the_same_batches(small, monkeypatch, caplog, free):
    def batches():
        dataset = shards.open_dataset(small, "train", seed=3, return_keys=True,
                                      decode=shards.Decode(decoder=label_decoder))
        loader = shards.make_loader(dataset, 4, mode=WorkerProcesses(2, persistent=False))
        return [(b[0].clone(), b[-1]) for b in loader]

    expected = batches()
    monkeypatch.setattr(worker_processes, "shm_free", lambda: free)
    with caplog.at_level(logging.WARNING, logger="shards.procs.shm"):
        got = batches()
    assert [keys for _, keys in got] == [keys for _, keys in expected]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, expected))
    assert len([r for r in caplog.records if "/dev/shm" in r.getMessage()]) == 1
    assert ("pipe" in caplog.text) == (free == 700)


_EPOCH = """
import logging, sys
sys.path.insert(0, {root!r})
import shards
from shards.loader.worker_processes import WorkerProcesses
logging.basicConfig(level=logging.WARNING, format="%(message)s")
dataset = shards.open_dataset({folder!r}, "train", seed=1, transform="train")
print("batches", sum(1 for _ in shards.make_loader(dataset, {batch}, mode=WorkerProcesses(2))))
"""


@pytest.mark.slow
@pytest.mark.parametrize("batch,how", [(128, "pipe"), (16, "ahead instead")])
def test_an_epoch_completes_on_a_64mb_dev_shm(tmp_path, batch, how):
    """A batch of 128 float 224px images (74 MiB) outgrows the whole tmpfs; 16 of them fit one per worker."""
    make_shard_dataset(tmp_path, shard_sizes={"train": [160, 160]}, size=(64, 64))
    code = textwrap.dedent(_EPOCH.format(root=str(ROOT), folder=str(tmp_path), batch=batch))
    shell = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} -c \"$0\""
    result = subprocess.run(["unshare", "-m", "sh", "-c", shell, code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"batches {320 // batch}" in result.stdout
    assert how in result.stderr and "unable to allocate shared memory" not in result.stderr
