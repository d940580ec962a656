"""Standardised features: the train split's per-dimension mean and std, and the layer that applies them.

Linear probes are compared against scikit-learn's ``StandardScaler`` + ``LogisticRegression``, so the numbers are
the scaler's: float64, the population std (``ddof=0``), and 1 for a dimension that never varies. They are computed
in one streamed pass over the rows the run trains on (``train_rows``: a subset's or mixture's selection, each row
once; ``--exclude-keys`` left out), shard by shard, merged with Chan's parallel update, which is exact to float64
rounding without holding the split. Every rank computes the same numbers from the same shards, so nothing is
communicated. The run records them in ``feature-scale.json`` (``train.run.run_dir``) and as buffers of the model
(``Standardize``), so ``last.pt``, ``best.pt`` and ``model.pt`` carry them and a prediction standardises exactly as
training did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from shards.errors import InputError

CHUNK_ROWS = 1 << 16  # rows converted to float64 at a time: bounded memory whatever a shard holds


@dataclass(frozen=True)
class FeatureScale:
    """Per-dimension mean and std (float64) of ``samples`` train rows."""

    mean: torch.Tensor
    std: torch.Tensor
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "mean": self.mean.tolist(), "std": self.std.tolist()}


def train_rows(dataset: Any) -> np.ndarray:
    """The global rows of the train split a run fits on, ascending, each once: a mixture's or subset's selected
    rows (weights, repeats and draws do not weigh them), else every row but those ``exclude_rows`` left out."""
    if dataset.mixture is not None:
        runs = [rows for source in dataset.mixture.runs for rows in source]
        return np.unique(np.concatenate(runs)) if runs else np.zeros(0, dtype=np.int64)
    rows = np.arange(dataset.split_info.samples, dtype=np.int64)
    return rows if dataset.excluded is None else rows[~np.isin(rows, dataset.excluded)]


def row_blocks(dataset: Any, rows: np.ndarray, *,
               features: bool = True) -> Iterator[tuple[np.ndarray, torch.Tensor | None, torch.Tensor]]:
    """``(positions, features, labels)`` for ``rows`` (ascending global rows), shard by shard and at most
    ``CHUNK_ROWS`` at a time: ``positions`` index ``rows``; ``features=False`` gathers labels only. Shards are read
    through the dataset, so they are checked against ``features.json`` and a mixture's labels are mapped to its
    combined classes."""
    offsets = np.cumsum([0] + list(dataset.split_info.shard_sizes))
    shard_of = np.searchsorted(offsets, rows, side="right") - 1
    for shard in np.unique(shard_of):
        loaded = dataset.shard(int(shard))
        positions = np.flatnonzero(shard_of == shard)
        for start in range(0, len(positions), CHUNK_ROWS):
            chosen = positions[start:start + CHUNK_ROWS]
            local = torch.from_numpy(rows[chosen] - offsets[shard])
            yield chosen, loaded.features[local] if features else None, dataset.values_of(loaded)[local]


def feature_scale(dataset: Any, rows: np.ndarray | None = None) -> FeatureScale:
    """The mean and std of ``rows`` (default ``train_rows``) in one pass; a non-finite value is an input error."""
    rows = train_rows(dataset) if rows is None else rows
    if len(rows) == 0:
        raise InputError("no train rows to standardise the features with")
    count, mean, squares = 0, None, None
    for _, features, _ in row_blocks(dataset, rows):
        block = features.double()
        n = block.shape[0]
        block_mean = block.mean(dim=0)
        block_squares = (block - block_mean).square().sum(dim=0)
        if mean is None:
            count, mean, squares = n, block_mean, block_squares
            continue
        delta = block_mean - mean
        total = count + n
        mean = mean + delta * (n / total)
        squares = squares + block_squares + delta.square() * (count * n / total)
        count = total
    std = (squares / count).sqrt()
    if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):
        dim = int((~(torch.isfinite(mean) & torch.isfinite(std))).nonzero()[0])
        raise InputError(f"the train features hold a value that is not finite (dimension {dim}): they cannot be "
                         "standardised; recompute them or train with --no-standardize")
    std = torch.where(std > 0, std, torch.ones_like(std))  # a constant dimension stays as it is (StandardScaler's rule)
    return FeatureScale(mean, std, count)


class Standardize(nn.Module):
    """``(x - mean) / std`` with the train split's numbers as buffers: saved and restored with the model."""

    def __init__(self, scale: FeatureScale):
        super().__init__()
        self.register_buffer("mean", scale.mean.float())
        self.register_buffer("std", scale.std.float())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return (inputs - self.mean) / self.std


class StandardizedHead(nn.Module):
    """A head fed standardised features: state dict keys ``scale.mean``, ``scale.std``, ``head.*``."""

    def __init__(self, scale: FeatureScale, head: nn.Module):
        super().__init__()
        self.scale = Standardize(scale)
        self.head = head

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.scale(inputs))


def describe(scale: FeatureScale) -> str:
    """One log line: how spread the dimensions are before standardising."""
    return (f"standardising {len(scale.mean)} feature dimensions with the mean and std of {scale.samples} train "
            f"rows (std {float(scale.std.min()):.3g} to {float(scale.std.max()):.3g})")
