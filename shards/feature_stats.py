"""The per-dimension statistics of a feature cache as ``features.json`` holds them (key ``feature_stats``).

``precompute-features`` accumulates them as it writes (``preprocess.features.feature_stats``) and refuses or warns
on what they show (docs/features.md, "Degenerate features"); ``shards report`` draws them. This module is the
contract between the two: the summary's fields, its version, and the checked reading of it, so a report never
trusts a number it did not check. The summary is compact: per-dimension mean and std as lists up to
``MAX_LISTED_DIMS`` dimensions, quantiles of the per-dimension std always.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from shards.door.shape import as_int, as_list, as_number, as_object, as_str
from shards.errors import ManifestError

STATS_KEY = "feature_stats"
STATS_VERSION = 1
MAX_LISTED_DIMS = 4096
STD_QUANTILES = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)
COUNTS = ("samples", "shards", "shards_total", "dims", "zero_dims", "constant_dims", "underflow_dims", "nonfinite",
          "overflow")
SHARES = ("zero_share", "underflow_share")


def _numbers(value: Any, what: str, length: int, where: str | None) -> tuple[float, ...]:
    items = as_list(value, what, max_len=MAX_LISTED_DIMS, where=where)
    if len(items) != length:
        raise ManifestError(f"{what} has {len(items)} values for {length} dimensions", path=where)
    return tuple(as_number(item, f"{what}[{i}]", where=where) for i, item in enumerate(items))


@dataclass(frozen=True)
class FeatureStatsSummary:
    """What a reader may rely on: counts, shares, the value range, the std quantiles, per-dim lists when small,
    and the warnings the run gave (``warnings``: one line each)."""

    samples: int
    shards: int  # feature shards whose statistics are in here (shards written before statistics existed are not)
    shards_total: int
    dims: int
    dtype: str
    zero_dims: int  # dimensions stored as 0 for every sample
    constant_dims: int  # dimensions with no variance across samples (dead), the zero ones included
    underflow_dims: int  # dimensions where most nonzero values were lost to the stored dtype
    nonfinite: int
    overflow: int
    zero_share: float  # of the stored values
    underflow_share: float  # of the values nonzero before the cast to the stored dtype
    value_min: float
    value_max: float
    std_quantiles: Mapping[str, float]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": STATS_VERSION, "dtype": self.dtype, "min": self.value_min,
                               "max": self.value_max, "std_quantiles": dict(self.std_quantiles),
                               "mean": None if self.mean is None else list(self.mean),
                               "std": None if self.std is None else list(self.std), "warnings": list(self.warnings)}
        out.update({name: getattr(self, name) for name in (*COUNTS, *SHARES)})
        return out

    @classmethod
    def from_json(cls, value: Any, where: str | None = None) -> "FeatureStatsSummary":
        data = as_object(value, STATS_KEY, where=where)
        version = data.get("version")
        if type(version) is not int or version != STATS_VERSION:
            raise ManifestError(f"{STATS_KEY} has version {version!r:.20}; this shardcache reads version "
                                f"{STATS_VERSION}", path=where)
        counts = {name: as_int(data.get(name), f"{STATS_KEY}.{name}", where=where) for name in COUNTS}
        shares = {name: as_number(data.get(name), f"{STATS_KEY}.{name}", where=where) for name in SHARES}
        quantiles = as_object(data.get("std_quantiles"), f"{STATS_KEY}.std_quantiles", where=where)
        lists = {name: None if data.get(name) is None else
                 _numbers(data[name], f"{STATS_KEY}.{name}", counts["dims"], where) for name in ("mean", "std")}
        warnings = as_list(data.get("warnings", []), f"{STATS_KEY}.warnings", max_len=64, where=where)
        return cls(**counts, **shares, **lists, dtype=as_str(data.get("dtype"), f"{STATS_KEY}.dtype", max_len=64,
                                                          where=where),
                   value_min=as_number(data.get("min"), f"{STATS_KEY}.min", where=where),
                   value_max=as_number(data.get("max"), f"{STATS_KEY}.max", where=where),
                   std_quantiles={str(k): as_number(v, f"{STATS_KEY}.std_quantiles.{k}", where=where)
                                  for k, v in list(quantiles.items())[:32]},
                   warnings=tuple(as_str(w, f"{STATS_KEY}.warnings", max_len=2000, where=where) for w in warnings))


def quantile_name(q: float) -> str:
    """``p50`` for 0.5, ``min`` and ``max`` at the ends: the keys of ``std_quantiles``."""
    return {0.0: "min", 1.0: "max"}.get(q, f"p{round(q * 100):02d}")


def std_histogram(std: Sequence[float], bins: int = 12) -> list[tuple[str, int]]:
    """Per-dimension std in decades (``1e-3..1e-2``), dead dimensions (std 0) in a bin of their own first."""
    dead = sum(1 for s in std if s <= 0)
    logs = [math.log10(s) for s in std if s > 0]
    out = [("0 (dead)", dead)]
    if not logs:
        return out
    low, high = math.floor(min(logs)), math.floor(max(logs))
    low = max(low, high - bins + 1)
    for decade in range(low, high + 1):
        n = sum(1 for v in logs if (math.floor(v) == decade or (decade == low and v < low)))
        out.append((f"1e{decade}", n))
    return out


def read_summary(extra: Mapping[str, Any], where: str | None = None) -> FeatureStatsSummary | None:
    """The summary a ``FeatureManifest.extra`` holds, None for a cache written before statistics existed; a
    summary of the wrong shape is a ``ManifestError`` naming the file."""
    value = extra.get(STATS_KEY)
    return None if value is None else FeatureStatsSummary.from_json(value, where)
