"""Batches in memory that is reused, not made anew for each batch and given back to the kernel after it.

A DataLoader worker collates each batch into a new shared-memory file, and the main process receives it tensor by
tensor: the file descriptor fetched over a fresh, authenticated socket from the worker's resource sharer, then
mapped; when the loop drops the batch, its pages go back to the kernel, on the main thread. Measured on 2 cores
with 64 uint8 224x224 images a batch (``scripts/bench/feed.py``): 17 us per image to receive and 19 us to free,
where a 20k img/s GPU leaves the main thread 50 us per image for everything. Both costs scale with the batch, not
with anything the training loop does. A thread run's batch costs the freeing alone (``BufferPool``).

So each worker process gets a ring of slots in one shared-memory block, made once by the main process before the
workers start (``SlabRing``). A worker collates a batch's large tensors straight into a free slot of its own and
sends only where they lie (``SlabRef``); small tensors (labels) travel in the result pipe (``Piped``), with no
file of their own. The main process lends the slot's bytes to the batch as a tensor without a copy (``lend``), and
the slot is free again when the last tensor viewing it is freed, in whatever thread that happens: the loop, the pin
thread, or a later step that kept the batch. A worker that finds all its slots lent (a loop that keeps batches)
collates that batch as before, into a new shared-memory file: slower, never blocked, never sharing a slot still in
use. A slot's pages stay mapped and touched, so the worker's next batch does not fault them in again either.

Nothing about a sample, its order or its bytes changes: only where the batch's tensors live on the way
(docs/streaming.md).
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import get_worker_info

from shards.procs.shm import SLAB_MIN_BYTES, Piped, Sent, collate_stacking, nested_map

ALIGN = 64  # each tensor in a slot starts on a cache line
_FREE, _FILLED = 0, 1

# The rings alive in this process, by token: a ``SlabRef`` pinned by the DataLoader's pin thread (which calls its
# ``pin_memory()``, knowing nothing of rings) finds its ring here. Weak: a ring lives as long as its loader run.
_RINGS: weakref.WeakValueDictionary[str, SlabRing] = weakref.WeakValueDictionary()
_TOKENS = itertools.count()


def lend(block: np.ndarray, start: int, dtype: torch.dtype, shape: tuple[int, ...],
         on_free: Callable[[], None]) -> torch.Tensor:
    """A tensor over ``block``'s bytes from ``start``, no copy; ``on_free`` runs once every tensor viewing them
    is freed (torch keeps the numpy view it was made from alive exactly that long)."""
    view = block[start:start + math.prod(shape) * dtype.itemsize]  # a view object of its own, ending at the batch's end
    weakref.finalize(view, on_free)
    tensor = torch.from_numpy(view)
    return (tensor if dtype == torch.uint8 else tensor.view(dtype)).view(shape)


class BufferPool:
    """Batch buffers a thread run reuses (``shards.loader.batch_fill``): the same cost, in one process. A batch
    tensor freed by the loop goes back to the pool instead of to the kernel (a 38 MB batch of 256 images is
    thousands of pages unmapped on the main thread, 12 us per image measured); at most ``keep`` wait there."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            free = self._free.get(nbytes)
            buffer = free.pop() if free else None
        if buffer is None:
            buffer = np.empty(nbytes, dtype=np.uint8)
        return lend(buffer, 0, dtype, shape, lambda: self._back(buffer))

    def _back(self, buffer: np.ndarray) -> None:
        with self._lock:
            free = self._free.setdefault(buffer.nbytes, [])
            if sum(map(len, self._free.values())) < self.keep:
                free.append(buffer)


@dataclass(frozen=True)
class SlabRef(Sent):
    """Where one tensor of a batch lies: ring ``token``, ``slot``, byte ``start``; ``parts``: how many tensors of
    the batch share the slot. In the main process a ref holds its slot until it is dropped or made a tensor, and
    the tensor then holds it: a batch torch discards unread (a stale one after an epoch left early) frees its slot
    as surely as one the loop used."""

    token: str
    slot: int
    start: int
    dtype: str
    shape: tuple[int, ...]
    parts: int

    def __reduce__(self) -> tuple:
        return _arrived, (self.token, self.slot, self.start, self.dtype, self.shape, self.parts)

    def tensor(self) -> torch.Tensor:
        ring = _RINGS.get(self.token)
        if ring is None:
            raise RuntimeError(f"a batch arrived for a loader run that has ended (ring {self.token})")
        return ring.receive(self)  # pinned by the pin thread (``Sent.pin_memory``), the slot is back at once


def _arrived(*fields: Any) -> SlabRef:
    """A ref unpickled in the main process: it holds its slot until it is dropped."""
    ref = SlabRef(*fields)
    ring = _RINGS.get(ref.token)
    if ring is not None:
        ring.hold(ref.slot, ref.parts)
        weakref.finalize(ref, ring.let_go, ref.slot)
    return ref


class SlabRing:
    """``slots`` slots of ``slot_bytes`` for each of ``workers`` workers, in one shared-memory block; which are
    filled lives in shared memory too. Made by the main process; a worker writes only its own slots, marks one
    filled, and the main process marks it free when the batch's last tensor over it is freed."""

    def __init__(self, workers: int, slots: int, slot_bytes: int):
        self.workers, self.slots = workers, slots
        self.slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
        self.block = torch.empty(workers * slots * self.slot_bytes, dtype=torch.uint8).share_memory_()
        self.state = torch.zeros(workers * slots, dtype=torch.int32).share_memory_()
        self.token = f"{id(self)}-{next(_TOKENS)}"
        self._bytes: np.ndarray | None = None  # the block and the slots' state as numpy, made once per process
        self._state: np.ndarray | None = None
        self._held: dict[int, int] = {}  # main process: slot -> refs and tensors over it still alive
        self._lock = threading.Lock()  # finalizers run in whichever thread frees the last view
        _RINGS[self.token] = self

    @property
    def nbytes(self) -> int:
        return int(self.block.numel())

    def __getstate__(self) -> dict:  # a spawned worker gets the shared tensors, not the main process's bookkeeping
        return {"workers": self.workers, "slots": self.slots, "slot_bytes": self.slot_bytes, "block": self.block,
                "state": self.state, "token": self.token}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._held, self._lock, self._bytes, self._state = {}, threading.Lock(), None, None

    def _flags(self) -> np.ndarray:
        if self._state is None:
            self._state = self.state.numpy()
        return self._state

    # worker side

    def acquire(self, worker: int) -> int | None:
        """A free slot of ``worker``'s, now marked filled; None when all are lent."""
        state = self._flags()
        for slot in range(worker * self.slots, (worker + 1) * self.slots):
            if state[slot] == _FREE:
                state[slot] = _FILLED
                return slot
        return None

    def slot_tensor(self, slot: int, start: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        at = slot * self.slot_bytes + start
        return self.block[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    # main side

    def hold(self, slot: int, parts: int) -> None:
        """One part of a batch in ``slot`` arrived: the first sets how many the slot waits for."""
        with self._lock:
            self._held.setdefault(slot, parts)

    def receive(self, ref: SlabRef) -> torch.Tensor:
        with self._lock:
            self._held[ref.slot] = self._held.get(ref.slot, 0) + 1  # the tensor holds it from here
        if self._bytes is None:
            self._bytes = self.block.numpy()
        return lend(self._bytes, ref.slot * self.slot_bytes + ref.start, getattr(torch, ref.dtype),
                    ref.shape, lambda: self.let_go(ref.slot))

    def let_go(self, slot: int) -> None:
        """A ref or a tensor over ``slot`` is gone; the last one frees the slot for its worker."""
        with self._lock:
            left = self._held.get(slot, 0) - 1
            if left > 0:
                self._held[slot] = left
                return
            self._held.pop(slot, None)
        self.release(slot)

    def release(self, slot: int) -> None:
        """``slot`` is free for its worker again."""
        self._flags()[slot] = _FREE

    def reclaim(self) -> None:
        """Free every slot no batch here holds: for when every worker that could be filling one has stopped (an
        epoch left early leaves its workers' last slots filled and never sent)."""
        with self._lock:
            held = set(self._held)
        for slot in range(len(self._flags())):
            if slot not in held:
                self.release(slot)


class _SlotWriter:
    """One batch's place in a slot: tensors laid end to end from byte 0."""

    def __init__(self, ring: SlabRing, slot: int):
        self.ring, self.slot, self.used, self.placed = ring, slot, 0, []

    def take(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < SLAB_MIN_BYTES or self.used + nbytes > self.ring.slot_bytes:
            return None
        out = self.ring.slot_tensor(self.slot, self.used, dtype, shape)
        self.placed.append((out.data_ptr(), self.used))
        self.used += -(-nbytes // ALIGN) * ALIGN
        return out

    def start_of(self, tensor: torch.Tensor) -> int | None:
        for pointer, start in self.placed:
            if tensor.data_ptr() == pointer:
                return start
        return None


class SlabCollate:
    """A worker's collate into its ring: ``collate_fn``'s batch, its large tensors in a slot (stacked there
    directly with torch's default collate; copied in with a caller's), the rest piped."""

    def __init__(self, collate_fn: Callable[[list], Any], ring: SlabRing):
        self.collate_fn, self.ring = collate_fn, ring

    def __call__(self, samples: list) -> Any:
        info = get_worker_info()
        slot = self.ring.acquire(info.id) if info is not None else None
        if slot is None:
            return self.collate_fn(samples)  # all lent: a batch of its own, as a DataLoader makes it
        writer = _SlotWriter(self.ring, slot)
        batch = collate_stacking(samples, self.collate_fn, _stacker(writer))
        refs: list[SlabRef] = []
        batch = nested_map(batch, lambda tensor: self._placed(tensor, writer, refs), torch.Tensor)
        if not refs:
            self.ring.release(slot)
            return batch
        return nested_map(batch, lambda ref: replace(ref, parts=len(refs)), SlabRef)

    def _placed(self, tensor: torch.Tensor, writer: _SlotWriter, refs: list[SlabRef]) -> Any:
        start = writer.start_of(tensor)
        if start is None and tensor.is_contiguous():
            out = writer.take(tensor.dtype, tuple(tensor.shape))
            if out is not None:
                out.copy_(tensor)
                start = writer.start_of(out)
        if start is None:
            return Piped.of(tensor) if tensor.nbytes < SLAB_MIN_BYTES else tensor
        ref = SlabRef(self.ring.token, writer.slot, start, str(tensor.dtype).removeprefix("torch."),
                      tuple(tensor.shape), 0)
        refs.append(ref)
        return ref


def _stacker(writer: _SlotWriter) -> Callable[..., torch.Tensor]:
    def stack(batch: list, *, collate_fn_map: Any = None) -> torch.Tensor:
        first = batch[0]
        out = writer.take(first.dtype, (len(batch), *first.shape))
        return torch.stack(batch, 0) if out is None else torch.stack(batch, 0, out=out)
    return stack

