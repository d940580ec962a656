"""A batch filled in place by the thread that decodes its samples: the thread run mode's collate.

A DataLoader worker collates a list of samples into a new tensor (a copy), in shared memory the main process then
maps (a hand-off), and pins it in one more thread (a copy). A loader thread lives in the training process: it
allocates the batch's tensor once, at the batch's first sample (pinned where the batch goes to a GPU), and copies
each decoded sample into its row as it comes, so the batch is ready the moment its last sample is, with nothing
left to stack, pickle or map.

The result has the structure ``default_collate`` gives the same samples (a list ``[images, labels(, keys)]``), so a
training loop cannot tell the modes apart. Samples that do not fit one tensor (images of different sizes, PIL
images, anything not a tensor) and a caller's ``collate_fn`` fall back to collating the list, as a worker would.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from shards.procs.slabs import BufferPool
from shards.procs.torch_private import default_collate, pin_nested


class BatchFill:
    """One batch at a time of up to ``batch_size`` samples; ``pin``: allocate in page-locked memory."""

    def __init__(self, batch_size: int, *, pin: bool = False, collate_fn: Callable | None = None,
                 buffers: BufferPool | None = None):
        self.batch_size = batch_size
        self.pin = pin
        self.collate_fn = collate_fn
        self.buffers = None if pin else buffers  # pinned memory has torch's own cache
        self._clear()

    def _clear(self) -> None:
        self.count = 0
        self.first: torch.Tensor | None = None  # the batch's first fields, filled in place
        self.rest: list[tuple] = []  # the other fields of each sample (labels, keys)
        self.listed: list[Any] | None = None  # samples collated as a list (fallback, or a caller's collate_fn)

    def add(self, sample: Any) -> None:
        if self.listed is None and self.collate_fn is None and self._fits(sample):
            if self.first is None:
                head = sample[0]
                shape = (self.batch_size, *head.shape)
                self.first = (self.buffers.tensor(head.dtype, shape) if self.buffers is not None
                              else torch.empty(shape, dtype=head.dtype, pin_memory=self.pin))
            self.first[self.count].copy_(sample[0])
            self.rest.append(sample[1:])
        else:
            if self.listed is None:  # the rows filled so far become list items: collated with the rest at the end
                self.listed = [(self.first[i], *self.rest[i]) for i in range(self.count)]
                self.first, self.rest = None, []
            self.listed.append(sample)
        self.count += 1

    def _fits(self, sample: Any) -> bool:
        if not isinstance(sample, tuple) or not sample or not isinstance(sample[0], torch.Tensor):
            return False
        if self.first is None:
            return True
        return sample[0].shape == self.first.shape[1:] and sample[0].dtype == self.first.dtype

    def take(self) -> Any:
        """The batch of the samples added since the last ``take``."""
        if self.listed is not None:
            batch = (self.collate_fn or default_collate)(self.listed)
            batch = pin_nested(batch) if self.pin else batch
        else:
            first = self.first if self.count == self.batch_size else self.first[: self.count]
            rest = [default_collate(column) for column in zip(*self.rest)]  # tuples, as a DataLoader's transpose
            batch = [first, *(pin_nested(column) for column in rest)] if self.pin else [first, *rest]
        self._clear()
        return batch
