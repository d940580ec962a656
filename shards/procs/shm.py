"""How worker processes hand batches to the training process so that ``/dev/shm`` cannot fill.

A DataLoader worker collates each batch straight into a shared-memory file (``/dev/shm``) and the main process maps
it; up to ``workers x prefetch_factor`` batches wait there, plus the one the loop holds and the one being pinned.
A container's ``/dev/shm`` is 64 MB unless the run asks for more (Docker's default), and when those batches
outgrow it a worker dies with torch's ``RuntimeError: unable to allocate shared memory(shm)`` in the middle of
an epoch (``set_sharing_strategy('file_system')`` does not help: its files live in ``/dev/shm`` too).

So the worker-process run measures the space ``/dev/shm`` has free when it starts (``shm_free``) and the bytes
of a batch (``shards.loader.budget.batch_bytes``), and ``plan_handoff``
picks the deepest prefetch whose batches fit in a share of that space. When not even one batch per worker fits,
the workers send their batches through the result queue's pipe instead (``PipedCollate`` turns a batch's tensors
into plain byte arrays that pickle in-band, never into shared memory; ``received`` makes them tensors again in
the main process): slower, but the epoch completes. Either fallback is said in one logged line. The hand-off changes
no sample and no order: only how many batches wait and which way they travel (docs/streaming.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from shards.procs.torch_private import collate, default_collate, default_collate_fn_map, pin_nested
from shards.units import human_bytes

log = logging.getLogger(__name__)

SHM_PATH = "/dev/shm"
# Of the space free at start, what the loader's batches may take: other processes (and the rank beside this one)
# use /dev/shm too, and a batch's size varies a little with its samples.
SHM_SHARE = 0.75
# Batches in shared memory beyond the prefetched ones: the one the loop holds, and the one being pinned.
EXTRA_BATCHES = 2
# Tensors smaller than this travel in the pipe, and a batch smaller than this gets no reused ring
# (``shards.procs.slabs``): a slot buys nothing for a batch's labels.
SLAB_MIN_BYTES = 64 << 10


def shm_free(path: str | os.PathLike = SHM_PATH) -> int | None:
    """Bytes free in ``path`` (``/dev/shm``) now, for an unprivileged writer; None where it cannot be measured."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


@dataclass(frozen=True)
class Handoff:
    """How batches leave the workers: ``prefetch_factor`` batches each ahead; ``piped``: through the result
    queue's pipe instead of shared memory; ``slots``: in a reused ring of shared memory; ``note``: the one line
    that says why, when it differs from asked."""

    prefetch_factor: int
    piped: bool = False
    note: str | None = None
    slots: int = 0  # slots per worker in a reused ring (``shards.procs.slabs``); 0: a new file per batch


def plan_handoff(free: int | None, batch: int, workers: int, prefetch_factor: int) -> Handoff:
    """The deepest prefetch (at most ``prefetch_factor``) whose ``workers x prefetch + EXTRA_BATCHES`` batches of
    ``batch`` bytes fit in ``SHM_SHARE`` of ``free``; the pipe, one batch ahead per worker, when none does."""
    if batch <= 0:
        return Handoff(prefetch_factor)
    if free is None:
        return Handoff(prefetch_factor, slots=ring_slots(None, batch, workers, prefetch_factor))
    room = int(free * SHM_SHARE)
    depth = min(prefetch_factor, (room // batch - EXTRA_BATCHES) // workers)
    if depth >= prefetch_factor:
        return Handoff(prefetch_factor, slots=ring_slots(room // batch, batch, workers, prefetch_factor))
    said = (f"{SHM_PATH} has {human_bytes(free)} free and a batch takes about {human_bytes(batch)}, so {workers} "
            f"worker processes x prefetch_factor {prefetch_factor} would not fit")
    if depth >= 1:
        return Handoff(depth, note=f"{said}: each worker prepares {depth} batch(es) ahead instead",
                       slots=ring_slots(room // batch, batch, workers, depth))
    return Handoff(1, piped=True, note=(
        f"{said}: batches come from the workers through a pipe instead of shared memory, one ahead each (slower; "
        f"a larger {SHM_PATH}, e.g. docker --shm-size, restores the default)"))


def ring_slots(room: int | None, batch: int, workers: int, depth: int) -> int:
    """Slots per worker for a reused ring (``shards.procs.slabs``) when ``room`` batches fit (None: not measured):
    one beyond the worker's ``depth`` in flight (the batch the loop holds), with room left for ``EXTRA_BATCHES``
    made anew when a loop keeps batches; 0 when that does not fit, or for a batch under ``SLAB_MIN_BYTES``."""
    slots = depth + 1
    fits = room is None or workers * slots + EXTRA_BATCHES <= room
    return slots if fits and batch >= SLAB_MIN_BYTES else 0


class Sent:
    """What a worker sends in a tensor's place (``Piped`` here, ``shards.procs.slabs.SlabRef``): ``tensor()`` is the
    tensor again in the main process, and the DataLoader's pin thread, which calls ``pin_memory()`` on whatever it
    finds in a batch, gets its pinned copy."""

    def tensor(self) -> torch.Tensor:
        raise NotImplementedError

    def pin_memory(self, device: Any = None) -> torch.Tensor:
        return self.tensor().pin_memory()


@dataclass(frozen=True)
class Piped(Sent):
    """A tensor's bytes as a numpy array, which pickles in-band through the worker's result pipe (a tensor would
    be moved to shared memory); ``dtype`` and ``shape`` make it the same tensor again."""

    data: np.ndarray
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Piped:
        flat = tensor.detach().contiguous().reshape(-1)
        return cls(flat.view(torch.uint8).numpy(), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.data).view(getattr(torch, self.dtype)).reshape(self.shape)


def _plain_stack(batch: Any, *, collate_fn_map: Any = None) -> torch.Tensor:
    return torch.stack(batch, 0)  # no ``out=`` in shared memory, which default_collate allocates in a worker


def collate_stacking(samples: list, collate_fn: Callable[[list], Any], stack: Callable[..., torch.Tensor]) -> Any:
    """``collate_fn``'s batch of ``samples``, with torch's default collate stacking tensors by ``stack`` (which
    decides where the batch's memory is) rather than into a new shared-memory file; a caller's ``collate_fn`` as
    it is."""
    if collate_fn is default_collate:
        return collate(samples, collate_fn_map={**default_collate_fn_map, torch.Tensor: stack})
    return collate_fn(samples)


def nested_map(value: Any, leaf: Callable[[Any], Any], kind: type | tuple[type, ...]) -> Any:
    """``value`` with each ``kind`` inside its dicts, lists, tuples and namedtuples replaced by ``leaf`` of it."""
    if isinstance(value, kind):
        return leaf(value)
    if isinstance(value, dict):
        return type(value)((key, nested_map(item, leaf, kind)) for key, item in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(nested_map(item, leaf, kind) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(nested_map(item, leaf, kind) for item in value)
    return value


class PipedCollate:
    """A worker's collate whose batch travels by pipe: ``collate_fn`` (torch's default stacks without shared
    memory), then every tensor of the batch as a ``Piped``."""

    def __init__(self, collate_fn: Callable[[list], Any]):
        self.collate_fn = collate_fn

    def __call__(self, samples: list) -> Any:
        return nested_map(collate_stacking(samples, self.collate_fn, _plain_stack), Piped.of, torch.Tensor)


def received(batch: Any, pin: bool) -> Any:
    """A batch that came piped or in ring slots, as tensors again (in page-locked memory when ``pin``: a piped
    batch's DataLoader does not pin it; what the pin thread already pinned is a tensor and stays as it is)."""
    batch = nested_map(batch, lambda sent: sent.tensor(), Sent)
    return pin_nested(batch) if pin else batch


def announce(handoff: Handoff) -> None:
    if handoff.note is not None:
        log.warning("%s", handoff.note)
