"""The smallest memory budget a loader runs in, for the tests that check a budget changes no sample, order or
resume (issue 46): the one its one-line refusal of a 1-byte budget names, so each test runs its mode at the edge
without restating how the mode counts its flight."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from shards.loader.budget import MemoryBudgetError
from tests.helpers import make_shard_dataset

SHARD_SIZES = {"train": [9, 8, 7]}


def label_decoder(sample, seed):
    """A decoder whose output size is known only by decoding (a custom one): a 3x4x4 tensor of the label."""
    return torch.full((3, 4, 4), float(sample.label))


def write_small_dataset(root):
    """Three small shards of 8x8 images, for loaders whose batches a budget or /dev/shm must fit."""
    make_shard_dataset(root, shard_sizes=SHARD_SIZES, size=(8, 8))
    return root


def smallest_budget(make: Callable[[int], Any]) -> int:
    """``make(memory)`` builds the loader; the smallest budget it works in, or 1 where a 1-byte budget is not
    refused (a mode whose only batch is the one the loop holds)."""
    loader = None
    try:
        loader = make(1)
        next(iter(loader), None)
    except MemoryBudgetError as refused:
        return int(re.search(r"\((\d+) bytes\)", str(refused)).group(1))
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return 1
