"""Batches in reused memory (``shards.procs.slabs``): a worker process's batch lands in a slot of its ring and
reaches the main process without a copy; the slot is free again only when the last tensor over it is gone, so a
loop that keeps its batches gets them unchanged (a worker then makes a batch of its own); a thread run's batch
buffers go back to a pool the same way. The batches are the ones every other mode gives."""

from __future__ import annotations

import gc
import pickle
import zlib

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import shards
from shards.loader.threads import Threads
from shards.loader.worker_processes import WorkerProcesses
from shards.procs import shm
from shards.procs.shm import plan_handoff
from shards.procs.shm import received
from shards.procs.slabs import SLAB_MIN_BYTES, BufferPool, SlabCollate, SlabRef, SlabRing
from shards.procs.torch_private import default_collate
from tests.helpers import make_shard_dataset

SHAPE = (3, 48, 64)  # uint8: 9 KiB a sample, so a batch of 8 is over SLAB_MIN_BYTES


def _in_ring(ring: SlabRing, tensor: torch.Tensor) -> bool:
    start = ring.block.data_ptr()
    return start <= tensor.data_ptr() < start + ring.nbytes


class Samples(IterableDataset):
    def __init__(self, count: int):
        self.count = count

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(info.id, self.count, info.num_workers):
            yield torch.full(SHAPE, i % 251, dtype=torch.uint8), i


def _loader(ring: SlabRing, collate_fn=default_collate, count: int = 64) -> DataLoader:
    return DataLoader(Samples(count), batch_size=8, num_workers=2, prefetch_factor=2,
                      collate_fn=SlabCollate(collate_fn, ring))


def _expected(images: torch.Tensor, labels: torch.Tensor) -> bool:
    return all(torch.equal(images[j], torch.full(SHAPE, int(label) % 251, dtype=torch.uint8))
               for j, label in enumerate(labels))


@pytest.mark.slow  # worker processes: over half a second on 2 cores
def test_a_batch_lands_in_the_ring_and_its_slot_is_free_when_dropped():
    ring = SlabRing(workers=2, slots=3, slot_bytes=8 * 3 * 48 * 64)
    seen = 0
    for batch in _loader(ring):
        images, labels = received(batch, pin=False)
        assert _in_ring(ring, images) and images.shape == (8, *SHAPE) and _expected(images, labels)
        assert isinstance(labels, torch.Tensor) and labels.dtype == torch.int64  # came through the pipe
        seen += len(labels)
        del batch, images, labels
    gc.collect()
    assert seen == 64
    assert ring.state.tolist() == [0] * 6  # every slot given back


def test_a_loop_that_keeps_every_batch_gets_them_unchanged():
    ring = SlabRing(workers=2, slots=2, slot_bytes=8 * 3 * 48 * 64)
    kept = [received(batch, pin=False) for batch in _loader(ring, count=64)]
    assert sum(len(labels) for _, labels in kept) == 64
    assert all(_expected(images, labels) for images, labels in kept)  # no slot was refilled under a kept batch
    in_ring = [_in_ring(ring, images) for images, _ in kept]
    assert 0 < sum(in_ring) <= 4  # the 4 slots, then batches of their own
    del kept
    assert ring.state.tolist() == [0] * 4


@pytest.mark.slow  # worker processes: over half a second on 2 cores
def test_a_callers_collate_output_is_copied_into_a_slot():
    def as_dict(samples):
        batch = default_collate(samples)
        return {"image": batch[0], "label": batch[1], "note": "kept"}

    ring = SlabRing(workers=2, slots=2, slot_bytes=8 * 3 * 48 * 64)
    batches = [received(batch, pin=False) for batch in _loader(ring, as_dict, count=32)]
    assert [b["note"] for b in batches] == ["kept"] * 4
    assert all(_expected(b["image"], b["label"]) for b in batches)
    assert _in_ring(ring, batches[0]["image"])


def test_a_ref_dropped_unread_frees_its_slot():
    ring = SlabRing(workers=1, slots=1, slot_bytes=SLAB_MIN_BYTES)
    assert ring.acquire(0) == 0 and ring.acquire(0) is None  # the worker's only slot is filled
    sent = pickle.dumps(SlabRef(ring.token, 0, 0, "uint8", (SLAB_MIN_BYTES,), 1))
    arrived = pickle.loads(sent)  # what torch receives, then discards (a stale batch)
    del arrived
    assert ring.acquire(0) == 0


def test_a_slot_with_two_tensors_waits_for_both():
    ring = SlabRing(workers=1, slots=1, slot_bytes=2 * SLAB_MIN_BYTES)
    slot = ring.acquire(0)
    refs = [pickle.loads(pickle.dumps(SlabRef(ring.token, slot, start, "uint8", (SLAB_MIN_BYTES,), 2)))
            for start in (0, SLAB_MIN_BYTES)]
    first, second = received(refs, pin=False)
    del refs
    del first
    assert ring.acquire(0) is None  # the second tensor still views the slot
    del second
    assert ring.acquire(0) == slot


def test_the_plan_gives_a_ring_only_where_it_fits():
    mib = 1 << 20
    assert plan_handoff(1 << 30, 10 * mib, 2, 4).slots == 5  # prefetch + the batch the loop holds
    assert plan_handoff(64 * mib, 9 * mib, 2, 4).slots == 0  # a shallower prefetch fits, a ring beside it not
    assert plan_handoff(64 * mib, 70 * mib, 2, 4).slots == 0  # the pipe
    assert plan_handoff(1 << 30, SLAB_MIN_BYTES - 1, 2, 4).slots == 0  # a ring would only move labels
    assert plan_handoff(None, 10 * mib, 2, 4).slots == 5  # /dev/shm not measurable: the ring as asked


def test_the_buffer_pool_reuses_a_freed_batch_and_keeps_at_most_keep():
    pool = BufferPool(keep=1)
    first = pool.tensor(torch.float32, (4, 5))
    pointer = first.data_ptr()
    del first
    again = pool.tensor(torch.float32, (4, 5))
    assert again.data_ptr() == pointer and again.shape == (4, 5) and again.dtype == torch.float32
    other = pool.tensor(torch.float32, (4, 5))  # the pool is empty: a new buffer
    assert other.data_ptr() != pointer
    del again, other
    assert sum(map(len, pool._free.values())) == 1


def _key_decoder(sample, seed):
    """A decoder of a large tensor that differs per sample, so a slot refilled under a kept batch would show."""
    return torch.full(SHAPE, zlib.crc32(sample.key.encode()) % 251, dtype=torch.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("slabs")
    make_shard_dataset(root, shard_sizes={"train": [20, 20]}, size=(8, 8))
    return root


def _dataset(folder):
    return shards.open_dataset(folder, "train", seed=5, return_keys=True, decode=shards.Decode(decoder=_key_decoder))


def _epoch(folder, mode):
    loader = shards.make_loader(_dataset(folder), 8, mode=mode)
    try:
        return loader, [batch for batch in loader]
    finally:
        loader.close()


@pytest.mark.slow  # worker processes: over half a second on 2 cores
def test_worker_processes_hand_over_in_the_ring_the_batches_every_mode_gives(folder, monkeypatch):
    loader, got = _epoch(folder, WorkerProcesses(2, persistent=True))
    ring = loader.run.ring
    assert ring is not None and any(_in_ring(ring, batch[0]) for batch in got)
    _, threads = _epoch(folder, Threads(2))
    monkeypatch.setattr(shm, "SLAB_MIN_BYTES", 1 << 40)  # no ring: a new shared file per batch
    plain_loader, plain = _epoch(folder, WorkerProcesses(2, persistent=True))
    assert plain_loader.run.ring is None
    for expected in (threads, plain):
        assert [batch[-1] for batch in got] == [batch[-1] for batch in expected]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected))


@pytest.mark.slow  # six epochs of fresh worker processes
def test_epochs_left_early_do_not_use_up_the_ring(folder):
    """Fresh workers each epoch: the slots an epoch left early had filled (and never sent) are free for the next."""
    loader = shards.make_loader(_dataset(folder), 8, mode=WorkerProcesses(2, persistent=False, prefetch=2))
    try:
        for epoch in range(5):
            loader.set_epoch(epoch)
            for _ in loader:
                break
        loader.set_epoch(5)
        last = list(loader)
        assert sum(len(batch[-1]) for batch in last) == 40
        assert all(_in_ring(loader.run.ring, batch[0]) for batch in last[:2])
    finally:
        loader.close()
