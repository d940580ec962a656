"""Feature shard files: one per image shard, same sample order and keys.

``.pt`` files hold ``{"features": Tensor[N, D], "labels": Tensor[N], "keys": list[str]}`` (plus
``"views": Tensor[N, K, D]`` when augmented views were cached) and load with ``weights_only=True, mmap=True``,
so nothing is unpickled and a large file is paged in lazily. ``.h5`` files hold datasets of the same names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from shards.atomic import atomic_output, sha256_file
from shards.errors import CorruptDataError, InputError

FEATURE_SUFFIXES = {"pt": ".pt", "hdf5": ".h5"}


@dataclass(frozen=True)
class FeatureShard:
    features: torch.Tensor  # [N, D]
    labels: torch.Tensor  # [N] int64
    keys: list[str]
    views: torch.Tensor | None = None  # [N, K, D] augmented views, when cached

    def __len__(self) -> int:
        return len(self.keys)


def feature_shard_name(image_shard_path: str, storage: str) -> str:
    """``train-000012.tar`` -> ``train-000012.pt``: the feature file aligned with an image shard."""
    if storage not in FEATURE_SUFFIXES:
        raise InputError(f"unknown feature format {storage!r}; choose one of {sorted(FEATURE_SUFFIXES)}")
    stem = Path(image_shard_path).name.split(".")[0]
    return stem + FEATURE_SUFFIXES[storage]


def write_feature_shard(path: str | os.PathLike, shard: FeatureShard, storage: str) -> tuple[int, str]:
    """Write atomically; return (bytes, sha256)."""
    path = Path(path)
    with atomic_output(path) as tmp:
        if storage == "pt":
            payload = {
                "features": shard.features.contiguous(),
                "labels": shard.labels.to(torch.int64).contiguous(),
                "keys": list(shard.keys),
            }
            if shard.views is not None:
                payload["views"] = shard.views.contiguous()
            torch.save(payload, tmp)
        elif storage == "hdf5":
            import h5py

            with h5py.File(tmp, "w") as f:
                feats = shard.features.numpy()
                rows = max(1, min(len(feats), 4096))
                f.create_dataset("features", data=feats, chunks=(rows, feats.shape[1]) if len(feats) else None,
                                 track_times=False)
                f.create_dataset("labels", data=shard.labels.to(torch.int64).numpy(), track_times=False)
                f.create_dataset("keys", data=np.array(shard.keys, dtype=object),
                                 dtype=h5py.string_dtype("utf-8"), track_times=False)
                if shard.views is not None:
                    f.create_dataset("views", data=shard.views.numpy(), track_times=False)
        else:
            raise InputError(f"unknown feature format {storage!r}; choose one of {sorted(FEATURE_SUFFIXES)}")
    return path.stat().st_size, sha256_file(path)


def load_feature_shard(path: str | os.PathLike, *, mmap: bool = True) -> FeatureShard:
    """Load a feature shard without unpickling anything (``weights_only=True``)."""
    path = Path(path)
    try:
        if path.suffix == ".pt":
            data = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            return FeatureShard(data["features"], data["labels"], list(data["keys"]), data.get("views"))
        if path.suffix == ".h5":
            import h5py

            with h5py.File(path, "r") as f:
                views = torch.from_numpy(f["views"][...]) if "views" in f else None
                return FeatureShard(
                    torch.from_numpy(f["features"][...]),
                    torch.from_numpy(f["labels"][...]),
                    [str(k) for k in f["keys"].asstr()[...]],
                    views,
                )
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch and h5py raise many types for a damaged file
        raise CorruptDataError(f"unreadable feature shard ({type(exc).__name__}: {exc})", path=str(path)) from exc
    raise InputError(f"unknown feature file suffix {path.suffix!r}", path=str(path))


def stack_rows(shards: Sequence[FeatureShard]) -> FeatureShard:
    """Concatenate shards (for small caches held in memory)."""
    views = [s.views for s in shards]
    return FeatureShard(
        torch.cat([s.features for s in shards]),
        torch.cat([s.labels for s in shards]),
        [k for s in shards for k in s.keys],
        torch.cat(views) if views and all(v is not None for v in views) else None,
    )
