"""The loader's memory budget: one byte limit on what it holds in flight, whatever its run mode.

What a loader holds beside the training step is the batches it has ready or is filling: in worker processes
``workers x prefetch_factor`` batches waiting (in shared memory) plus the one the loop holds and the one being
pinned; in threads each thread's queue plus the batch it fills; in process the one batch. Each mode's depth was
its own knob and nothing added them up, so a container's memory limit was met by whatever they multiplied to.

``MemoryBudget`` is that limit, per rank. ``split_budget`` divides it (``BudgetParts``): remote read-ahead and
feature windows as the dataset holds them, decode-ahead within a share, and the batches in flight the rest. A run
mode learns a batch's bytes at its first iteration (from the transform's fixed output size where it has one, else
one sample decoded in a forked child for worker processes, here for threads: ``batch_bytes``) and ``fit_depth`` gives the deepest prefetch at most as
asked whose flight fits; a budget below one batch per worker is refused in one line naming the smallest that works.
The default is ``DEFAULT_SHARE`` of the memory this job may still fill (the cgroup's limit, v1 or v2, else the
machine's: ``shards.cache.memory_budget``), divided by the ranks on this node that the caller names. The budget
changes how many batches wait, never which samples a batch holds or their order (docs/streaming.md, "Memory
budget").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shards.cache.memory_budget import MemoryView, memory_view
from shards.errors import InputError
from shards.jobs.parallel import start_context
from shards.stream.worker_stream import StreamJob
from shards.units import human_bytes, parse_size

DEFAULT_SHARE = 0.25  # of the memory left to the job: the training step, the model and the caches need the rest


class MemoryBudgetError(InputError):
    """A memory budget too small for the loader's run mode to hold one batch per worker."""


@dataclass(frozen=True)
class MemoryBudget:
    """At most ``limit`` bytes in flight in this rank's loader; ``source``: where the number came from (stated in
    the run record)."""

    limit: int
    source: str = "given"
    ranks: int = 1  # ranks on this node that share the default (1 for a given budget: it is this rank's)

    def __str__(self) -> str:
        return f"{human_bytes(self.limit)} ({self.source})"

    def record(self, **parts: int) -> dict[str, Any]:
        """The budget as the run record states it (train's ``run.json``, precompute's summary): bytes, where they
        came from (given, or the default's share of the cgroup v1/v2 or machine memory), the ranks on the node,
        and the ``parts`` a caller sized from it (``read_ahead_bytes``...)."""
        return {"bytes": self.limit, "source": self.source, "share": None if self.source == "given" else DEFAULT_SHARE,
                "ranks_on_node": self.ranks, **parts}


def default_budget(view: MemoryView | None = None, ranks: int = 1) -> MemoryBudget:
    """``DEFAULT_SHARE`` of what the job may still fill, divided between the ``ranks`` on this node (the caller
    says how many: under torchrun, train's ``DistContext.local_world_size``; nothing here reads the environment)."""
    view = memory_view() if view is None else view
    ranks = max(1, ranks)
    limit = int(DEFAULT_SHARE * view.available) // ranks
    return MemoryBudget(limit, f"default: {DEFAULT_SHARE:g} of {human_bytes(view.available)} available from "
                               f"{view.source}, / {ranks} rank(s) on this node", ranks)


def resolve_budget(memory: int | str | MemoryBudget | None, ranks: int = 1) -> MemoryBudget:
    """A ``make_loader(memory=...)`` value as a budget: bytes, a size string (``"512MiB"``), a budget, or None
    for the default (shared by ``ranks`` on this node)."""
    if memory is None:
        return default_budget(ranks=ranks)
    if isinstance(memory, MemoryBudget):
        return memory
    limit = parse_size(memory, "memory")
    if limit <= 0:
        raise InputError(f"memory={memory!r} must be a positive number of bytes (or None for the default)")
    return MemoryBudget(limit)


def sample_bytes(sample: Any) -> int:
    """The bytes a decoded sample adds to a collated batch: tensors and arrays by size, PIL images by pixels."""
    if isinstance(sample, torch.Tensor):
        return sample.element_size() * sample.numel()
    if isinstance(sample, np.ndarray):
        return sample.nbytes
    if isinstance(sample, (bytes, bytearray, str)):
        return len(sample)
    if isinstance(sample, dict):
        return sum(sample_bytes(value) for value in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(sample_bytes(value) for value in sample)
    if hasattr(sample, "size") and hasattr(sample, "getbands"):  # a PIL image: collated as uint8 pixels
        width, height = sample.size
        return width * height * len(sample.getbands())
    return 8  # a label or other number: one int64


KEY_BYTES = 96  # a sample key as a Python string in a batch (``return_keys``): a short name and its object


def fixed_sample_bytes(dataset: Any) -> int | None:
    """A sample's bytes from its ``TransformSpec`` where the output size is fixed: the fast decode's uint8
    ``[3, size, size]``, the standard pipeline's float32 one; with its label (and key). None for a custom decoder
    or transform, whose output only a decode can tell."""
    from shards.image.decode import ImageDecoder
    from shards.image.fast import FastDecoder
    from shards.image.transforms import PilTransform

    decoder = getattr(dataset, "decoder", None)
    if type(decoder) is FastDecoder:
        spec, itemsize = decoder.spec, 1
    elif type(decoder) is ImageDecoder and type(decoder.transform) is PilTransform:
        spec, itemsize = decoder.transform.spec, 4
    else:  # a subclass or another decoder (precompute's views, raw bytes for the device) makes its own outputs
        return None
    keys = KEY_BYTES if getattr(dataset.config, "return_keys", False) else 0
    return 3 * spec.size * spec.size * itemsize + 8 + keys


def batch_bytes(dataset: Any, batch_size: int, workers: int, *, isolated: bool = False) -> int:
    """A batch's bytes: from the transform's fixed output size (``fixed_sample_bytes``: no decode, so no extra
    fetch of a cold remote shard), else, for local shards, from the first sample of this epoch's first worker
    decoded once (pure: the same sample a worker decodes; nothing recorded or timed). ``isolated`` decodes it in a
    forked child, as worker processes would: a decoder that exits, crashes on a hostile file or hangs then costs
    the probe (``PROBE_TIMEOUT_S`` at most), not the training process its watchdog protects. 0 when unknown: no
    sample, remote shards (a probe would fetch, and cache, a shard no worker asked for), a probe that failed; then
    the depth stays as asked."""
    fixed = fixed_sample_bytes(dataset)
    if fixed is not None:
        return fixed * batch_size
    if _reads_remotely(dataset):
        return 0
    job = StreamJob(dataset.epoch, 0, max(1, workers), split_batch=batch_size)
    size = _probe_in_child(dataset, job) if isolated else _probe(dataset, job)
    return size * batch_size


PROBE_TIMEOUT_S = 10.0


def _probe(dataset: Any, job: StreamJob) -> int:
    stream = dataset.worker_stream(job)
    try:
        first = next(iter(stream), None)
    except Exception:  # a sample the workers will quarantine: the size stays unknown
        first = None
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()
    return 0 if first is None else sample_bytes(first)


def _probe_child(dataset: Any, job: StreamJob, out: Any) -> None:
    out.send_bytes(_probe(dataset, job).to_bytes(8, "little"))


def _probe_in_child(dataset: Any, job: StreamJob) -> int:
    """``_probe`` in a forked child (as DataLoader workers start); the answer comes back as 8 bytes, unpickled."""
    context = start_context()
    if context.get_start_method() != "fork":
        return 0
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_probe_child, args=(dataset, job, writer), daemon=True)
    child.start()
    writer.close()
    try:
        answer = reader.recv_bytes(8) if reader.poll(PROBE_TIMEOUT_S) else b""
    except (EOFError, OSError):  # the child died before answering
        answer = b""
    finally:
        reader.close()
        if child.is_alive():
            child.kill()
        child.join()
    return int.from_bytes(answer, "little") if len(answer) == 8 else 0


def feature_row_bytes(dataset: Any) -> int | None:
    """A feature row's bytes as the in-process loader gathers it: ``features_dim`` values of the manifest's dtype,
    the label (or target) and the key; None where the manifest gives no dimension."""
    dim = getattr(dataset, "features_dim", None)
    if not dim:
        return None
    dtype = getattr(torch, str(getattr(dataset, "dtype", "float32")), torch.float32)
    keys = KEY_BYTES if getattr(dataset.config, "return_keys", False) else 0
    return dim * dtype.itemsize + 8 + keys


# How a budget is divided (``split_budget``): what reads and decodes ahead first, within these shares; the batches
# in flight take the rest, and their depth is fitted to it.
READ_AHEAD_SHARE = 0.25  # remote bytes fetched ahead, all of the loader's processes together
DECODE_AHEAD_SHARE = 0.125  # samples decode threads finished ahead of the batch that takes them


@dataclass(frozen=True)
class BudgetParts:
    """A budget divided between what a loader holds beside the training step:

    - ``batches``: batches ready, queued, in shared memory, being filled or held by the loop (the mode's prefetch
      depth and queues are fitted to it, ``fit_depth``);
    - ``decode_ahead``: samples decode threads finished ahead of their batch, ``ahead`` per stream
      (``WorkerProcesses(decoders=m)``, ``Threads(decoders=k)``; ``shards.stream.decode_ahead``);
    - ``read_ahead``: remote bytes fetched ahead, every process of the loader together
      (``S3Options.read_ahead_bytes`` each, sized with ``read_ahead_within``). The node cache's fetches go
      through the same read-ahead, so this is its RAM part too: the shards it keeps are on disk;
    - ``windows``: feature windows gathered ahead in process (``shards.loader.feature_prefetch``: the one being
      served and the next).

    The decoded-image cache (``--cache-images``) has its own limit (``MemoryCache``, ``--memory-limit``) and is
    not part of it."""

    batches: int
    decode_ahead: int = 0
    read_ahead: int = 0
    windows: int = 0
    ahead: int = 0

    @property
    def reserved(self) -> int:
        """What is held beside the batches."""
        return self.decode_ahead + self.read_ahead + self.windows


def split_budget(budget: MemoryBudget, *, sample: int = 0, streams: int = 1, ahead: int = 0, read_ahead: int = 0,
                 windows: int = 0, need: int = 0) -> BudgetParts:
    """``budget`` divided: ``read_ahead`` and ``windows`` bytes as the dataset holds them; decode-ahead at most
    ``ahead`` samples of ``sample`` bytes per stream (at least 1, so decode threads still overlap), fewer where
    ``DECODE_AHEAD_SHARE`` of the budget says or where the batches would get less than ``need`` (their least:
    one per worker and the extras), so the smallest budget ``fit_depth`` names is one that works; the batches
    the rest (less than ``need`` when the others fill it: ``fit_depth`` refuses it then)."""
    if ahead and sample > 0:
        ahead = min(ahead, max(1, int(budget.limit * DECODE_AHEAD_SHARE) // (streams * sample)))
        room = budget.limit - read_ahead - windows - need
        ahead = min(ahead, max(1, room // (streams * sample)))
    decode = ahead * streams * sample
    return BudgetParts(budget.limit - decode - read_ahead - windows, decode, read_ahead, windows, ahead)


def read_ahead_within(budget: MemoryBudget, processes: int, asked: int) -> int:
    """Each reading process's read-ahead (``S3Options.read_ahead_bytes``): ``asked``, at most its share of
    ``READ_AHEAD_SHARE`` of the budget."""
    return min(asked, int(budget.limit * READ_AHEAD_SHARE) // max(1, processes))


def _reads_remotely(dataset: Any) -> bool:
    from shards.transport.location import locate

    locations = getattr(dataset, "locations", ())
    return any(locate(location).local_path() is None for location in locations[:64])


def dataset_read_ahead(dataset: Any, processes: int) -> int:
    """The remote bytes ``processes`` readers of ``dataset`` fetch ahead at most (its ``S3Options``; the same for
    http(s)); 0 for local shards."""
    from shards.transport.s3 import S3Options

    if not _reads_remotely(dataset):
        return 0
    return S3Options.from_mapping(getattr(dataset, "storage_options", None)).read_ahead_bytes * max(1, processes)


def fit_depth(budget: MemoryBudget | None, batch: int, workers: int, asked: int, extra: int, mode: Any,
              reserved: int = 0) -> int:
    """The deepest prefetch (1..``asked``) whose ``(workers x depth + extra)`` batches of ``batch`` bytes fit the
    budget beside the ``reserved`` bytes of its other parts (``BudgetParts.reserved``); a ``MemoryBudgetError``
    naming the smallest budget that works when depth 1 does not."""
    if budget is None or batch <= 0:
        return asked
    depth = min(asked, ((budget.limit - reserved) // batch - extra) // workers)
    if depth < 1:
        smallest = (workers + extra) * batch + reserved
        beside = f", beside {human_bytes(reserved)} read, decoded or gathered ahead" if reserved else ""
        raise MemoryBudgetError(
            f"memory budget {human_bytes(budget.limit)} is too small for {mode}: a batch takes about "
            f"{human_bytes(batch)} and it holds {workers} + {extra} at least{beside}; the smallest that works is "
            f"{human_bytes(smallest)} ({smallest} bytes)")
    return depth
