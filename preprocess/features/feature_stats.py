"""What ``precompute-features`` checks in the features it writes, so a degenerate cache never passes in silence.

A random-init backbone can put out activations near 1e-9 that float16 stores as 0.0; a diverged AMP pass puts
out NaN; a probe trained on either sits at chance and nothing says why. So per-dimension running statistics are
kept as features are computed (``FeatureStats.update``: a few reductions per batch on the device, no per-sample
Python): count, mean and M2 (Chan's parallel update), min and max, stored zeros, and the values lost to the stored
dtype (nonzero in float32, zero or subnormal in float16: underflow; finite, then infinite: overflow).

- **Per shard, before it is written** (``check_shard``): NaN/inf from the backbone, or float16 overflow, refuses
  the run: such a row poisons every epoch that reads it.
- **At the end** (``check_features``, when ``features.json`` is put together from every shard's record): every
  stored value zero, or every dimension constant across samples, refuses (nothing to learn from); underflow of
  more than ``UNDERFLOW_WARNING_SHARE`` of the nonzero values, or more than ``CONSTANT_WARNING_SHARE`` of the
  dimensions dead, or every value below ``TINY_SCALE``, warns. Each line names the fix (``--dtype float32``, real weights via ``--weights FILE``).

A shard's statistics live in its record beside it (``.precompute/``), so a resumed run or an array of tasks
merges them exactly as one run would; the summary ``features.json`` holds is ``shards.feature_stats``' contract.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from shards.errors import InputError
from shards.feature_stats import MAX_LISTED_DIMS, STD_QUANTILES, FeatureStatsSummary, quantile_name

log = logging.getLogger(__name__)

UNDERFLOW_WARNING_SHARE = 0.01  # of the values nonzero in float32
CONSTANT_WARNING_SHARE = 0.25  # of the dimensions
TINY_SCALE = 1e-4  # largest |value| below it: a random init's vanishing activations (pretrained ones are O(1))
RECORD_VERSION = 1
# name -> stored dtype of the per-dimension arrays in a shard's record
ARRAYS = {"mean": "<f8", "m2": "<f8", "min": "<f4", "max": "<f4", "zeros": "<i8", "underflow": "<i8"}
SCALARS = ("samples", "nonzero", "nonfinite", "overflow")
FIX_DTYPE = "--dtype float32 keeps them"
FIX_WEIGHTS = "a random init (--weights none) gives features near zero: pass real weights with --weights FILE"


class FeatureStats:
    """Running per-dimension statistics of ``dims``-wide features: on the device the features are on."""

    def __init__(self, dims: int, device: torch.device | str = "cpu"):
        self.dims = dims
        zeros = lambda dtype: torch.zeros(dims, dtype=dtype, device=device)  # noqa: E731
        self.mean, self.m2 = zeros(torch.float64), zeros(torch.float64)
        self.min = torch.full((dims,), math.inf, dtype=torch.float32, device=device)
        self.max = torch.full((dims,), -math.inf, dtype=torch.float32, device=device)
        self.zeros, self.underflow = zeros(torch.int64), zeros(torch.int64)
        self.counts = torch.zeros(len(SCALARS), dtype=torch.int64, device=device)  # SCALARS' order
        self.samples = 0  # also counts[0]; kept on the host so an update never waits for the device

    def scalar(self, name: str) -> int:
        return int(self.counts[SCALARS.index(name)])

    @torch.inference_mode()
    def update(self, computed: torch.Tensor, stored: torch.Tensor) -> None:
        """Add a batch: ``computed`` the backbone's float32 rows [n, D], ``stored`` the same cast to the output
        dtype (what the file will hold)."""
        if len(computed) == 0:
            return
        values = stored.double()
        finite = torch.isfinite(computed)
        tiny = torch.finfo(stored.dtype).tiny  # below it float16 stores zero or a subnormal
        nonzero = computed != 0
        self.underflow += (nonzero & (stored.abs() < tiny)).sum(0)
        self.zeros += (stored == 0).sum(0)
        self.min = torch.minimum(self.min, stored.float().amin(0))
        self.max = torch.maximum(self.max, stored.float().amax(0))
        batch_mean = values.mean(0)
        batch_m2 = ((values - batch_mean) ** 2).sum(0)
        self._merge(len(values), batch_mean, batch_m2)
        self.samples += len(values)
        self.counts += torch.stack([torch.tensor(len(values), device=values.device), nonzero.sum(),
                                    (~finite).sum(), (finite & ~torch.isfinite(stored)).sum()])

    def _merge(self, n: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        before = self.samples
        total = before + n
        delta = mean - self.mean
        self.mean += delta * (n / total)
        self.m2 += m2 + delta ** 2 * (before * n / total)

    @torch.inference_mode()
    def merge(self, other: "FeatureStats") -> None:
        """Add another shard's statistics (Chan's parallel update: the same as one pass over both)."""
        if other.samples == 0:
            return
        self._merge(other.samples, other.mean.to(self.mean.device), other.m2.to(self.m2.device))
        self.samples += other.samples
        self.min = torch.minimum(self.min, other.min.to(self.min.device))
        self.max = torch.maximum(self.max, other.max.to(self.max.device))
        self.zeros += other.zeros.to(self.zeros.device)
        self.underflow += other.underflow.to(self.underflow.device)
        self.counts += other.counts.to(self.counts.device)

    def to_record(self) -> dict[str, Any]:
        """A shard record's ``stats``: the arrays little-endian in base64 (a few hundred KiB at most)."""
        arrays = {name: base64.b64encode(getattr(self, name).cpu().numpy().astype(kind).tobytes()).decode("ascii")
                  for name, kind in ARRAYS.items()}
        return {"version": RECORD_VERSION, "dims": self.dims, **{name: self.scalar(name) for name in SCALARS},
                **arrays}

    @classmethod
    def from_record(cls, record: Any, dims: int) -> "FeatureStats | None":
        """A shard record's statistics, or None when absent or not of this shape (the summary then says how many
        shards it covers)."""
        if not isinstance(record, Mapping) or record.get("version") != RECORD_VERSION or record.get("dims") != dims:
            return None
        stats = cls(dims)
        try:
            for name, kind in ARRAYS.items():
                array = np.frombuffer(base64.b64decode(record[name], validate=True), dtype=kind)
                if array.shape != (dims,):
                    return None
                setattr(stats, name, torch.from_numpy(array.astype(kind[1:])))
            counts = [record[name] for name in SCALARS]
        except (KeyError, TypeError, ValueError):
            return None
        if any(type(c) is not int or c < 0 for c in counts):
            return None
        stats.counts = torch.tensor(counts, dtype=torch.int64)
        stats.samples = counts[0]
        return stats


def check_shard(stats: FeatureStats, where: str) -> None:
    """Refuse a shard whose features are not finite (the backbone's NaN/inf, or values float16 cannot hold)."""
    nonfinite, overflow = stats.scalar("nonfinite"), stats.scalar("overflow")
    if nonfinite:
        raise InputError(f"the backbone put out {nonfinite:,} NaN/inf feature values: refused (diverged weights or "
                         "an AMP pass that overflowed; try --amp off, or other --weights)", path=where)
    if overflow:
        raise InputError(f"{overflow:,} feature values exceed float16's range (65504) and would be stored as inf: "
                         f"refused; {FIX_DTYPE}", path=where)


def _rounded(values: torch.Tensor) -> list[float]:
    return [float(f"{v:.6g}") for v in values.tolist()]


def summarize(stats: FeatureStats, dtype: str, shards: int, shards_total: int) -> FeatureStatsSummary:
    """The summary ``features.json`` holds, with the warnings ``judge`` finds in it."""
    n = stats.samples
    std = (stats.m2 / max(n, 1)).clamp(min=0).sqrt()
    constant = std <= 0 if n > 1 else torch.zeros(stats.dims, dtype=torch.bool)
    zero_dims = int((stats.zeros == n).sum()) if n else 0
    nonzero = stats.scalar("nonzero")
    quantiles = torch.quantile(std.float(), torch.tensor(STD_QUANTILES)) if n else torch.zeros(len(STD_QUANTILES))
    listed = stats.dims <= MAX_LISTED_DIMS
    summary = FeatureStatsSummary(
        samples=n, shards=shards, shards_total=shards_total, dims=stats.dims, dtype=dtype, zero_dims=zero_dims,
        constant_dims=int(constant.sum()), underflow_dims=int((stats.underflow * 2 > n).sum()) if n else 0,
        nonfinite=stats.scalar("nonfinite"), overflow=stats.scalar("overflow"),
        zero_share=float(stats.zeros.sum()) / max(n * stats.dims, 1),
        underflow_share=float(stats.underflow.sum()) / nonzero if nonzero else 0.0,
        value_min=float(stats.min.min()) if n else 0.0, value_max=float(stats.max.max()) if n else 0.0,
        std_quantiles={quantile_name(q): float(f"{v:.6g}") for q, v in zip(STD_QUANTILES, quantiles.tolist())},
        mean=tuple(_rounded(stats.mean)) if listed and n else None, std=tuple(_rounded(std)) if listed and n else None)
    return dataclasses.replace(summary, warnings=tuple(judge(summary)[1]))


def judge(summary: FeatureStatsSummary) -> tuple[list[str], list[str]]:
    """(errors, warnings), one line each with its fix. Errors: NaN/inf or overflow, every value zero, every
    dimension constant. Warnings: underflow, many dead dimensions."""
    errors, warnings = [], []
    n, dims = summary.samples, summary.dims
    lost = f"{summary.underflow_share:.0%} of the nonzero values underflowed to zero or subnormal in {summary.dtype}"
    if summary.nonfinite or summary.overflow:
        errors.append(f"{summary.nonfinite + summary.overflow:,} feature values are NaN/inf")
    if n and summary.zero_dims == dims:
        cause = f" ({lost}: {FIX_DTYPE})" if summary.underflow_share > UNDERFLOW_WARNING_SHARE else ""
        errors.append(f"every stored feature value is zero{cause}; {FIX_WEIGHTS}")
    elif n > 1 and summary.constant_dims == dims:
        errors.append(f"every feature dimension is constant across the {n:,} samples: the features carry nothing "
                      f"about the images; {FIX_WEIGHTS}")
    if errors:
        return errors, warnings
    if summary.underflow_share > UNDERFLOW_WARNING_SHARE:
        warnings.append(f"{lost} ({summary.underflow_dims:,} of {dims:,} dimensions mostly): {FIX_DTYPE}; if the "
                        f"features are this small, {FIX_WEIGHTS}")
    scale = max(abs(summary.value_min), abs(summary.value_max))
    if n and 0 < scale < TINY_SCALE:
        warnings.append(f"every feature value is below {scale:.1g} in magnitude: an SGD head barely moves on them "
                        f"(train with --standardize); {FIX_WEIGHTS}")
    if n > 1 and summary.constant_dims > CONSTANT_WARNING_SHARE * dims:
        warnings.append(f"{summary.constant_dims:,} of {dims:,} feature dimensions are constant across the {n:,} "
                        "samples (dead): a probe learns nothing from them; check the --weights")
    return errors, warnings


def check_features(records: Sequence[Any], *, dims: int, dtype: str, where: str) -> FeatureStatsSummary:
    """The summary of every shard record's ``stats`` (``records``: one per shard, None where absent); raises the
    first error as one ``InputError`` line, logs each warning."""
    total = FeatureStats(dims)
    covered = 0
    for record in records:
        stats = FeatureStats.from_record(record, dims)
        if stats is not None:
            total.merge(stats)
            covered += 1
    summary = summarize(total, dtype, covered, len(records))
    errors, warnings = judge(summary)
    if errors:
        raise InputError(f"degenerate features, refused: {errors[0]}", path=where)
    for line in warnings:
        log.warning("%s: %s", where, line)
    return summary
