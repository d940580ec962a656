"""Feature shard files: one per image shard, same sample order and keys.

``.pt`` files hold ``{"features": Tensor[N, D], "labels": Tensor[N], "keys": list[str]}`` (plus
``"views": Tensor[N, K, D]`` when augmented views were cached, and ``"targets": float32 Tensor[N]`` for a
regression table, whose labels are all-zero placeholders) and load with ``weights_only=True, mmap=True``, so nothing
is unpickled and a large file is paged in lazily. ``.h5`` files hold datasets of the same names, except the keys:
a text column without variable-length data (``key_bytes`` and ``key_ends``, ``shards.formats.h5columns``), in
layout ``version`` ``H5_VERSION``; a file of another layout is refused, never read (0.x: no read-both). Files
written before an optional entry (views, targets) existed load with it as None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from shards.atomic import atomic_output, sha256_file
from shards.door.bounded_read import load_weights_only, open_regular_file, parser_guard
from shards.errors import ChecksumError, CorruptDataError, InputError
from shards.formats.h5columns import VERSION_ATTR, check_version, checked_dataset, read_text_column, write_text_column

# The names and the task rule need no torch (``pack-shards`` imports them); they live in feature_names.
from shards.formats.feature_names import FEATURE_SUFFIXES, target_task

H5_VERSION = 2  # the .h5 layout: 1 held the keys as variable-length strings (a corrupt global heap hung the reader)
CORRUPT_H5 = "corrupt feature shard"


@dataclass(frozen=True)
class FeatureShard:
    features: torch.Tensor  # [N, D]
    labels: torch.Tensor  # [N] int64
    keys: list[str]
    views: torch.Tensor | None = None  # [N, K, D] augmented views, when cached
    targets: torch.Tensor | None = None  # [N] float32 regression targets (a regression table), else None

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
            if shard.targets is not None:
                payload["targets"] = shard.targets.to(torch.float32).contiguous()
            # Through a file object: given a path, torch names the archive inside after the (unique) temp name,
            # and the bytes would differ from run to run.
            with open(tmp, "wb") as handle:
                torch.save(payload, handle)
        elif storage == "hdf5":
            import h5py

            with h5py.File(tmp, "w") as f:
                f.attrs[VERSION_ATTR] = np.int64(H5_VERSION)
                feats = shard.features.numpy()
                rows = max(1, min(len(feats), 4096))
                f.create_dataset("features", data=feats, chunks=(rows, feats.shape[1]) if len(feats) else None,
                                 track_times=False)
                f.create_dataset("labels", data=shard.labels.to(torch.int64).numpy(), track_times=False)
                write_text_column(f, "key", shard.keys)
                if shard.views is not None:
                    f.create_dataset("views", data=shard.views.numpy(), track_times=False)
                if shard.targets is not None:
                    f.create_dataset("targets", data=shard.targets.to(torch.float32).numpy(), track_times=False)
        else:
            raise InputError(f"unknown feature format {storage!r}; choose one of {sorted(FEATURE_SUFFIXES)}")
    return path.stat().st_size, sha256_file(path)


def load_feature_shard(path: str | os.PathLike, *, mmap: bool = True, samples: int | None = None) -> FeatureShard:
    """Load a feature shard without unpickling anything (``weights_only=True``). ``samples``: the count its
    manifest records, which an ``.h5`` file's datasets are checked against before they are read."""
    path = Path(path)
    where = str(path)
    if path.suffix == ".pt":
        data = load_weights_only(path, where, "unreadable feature shard", mmap=mmap)
        with parser_guard(where, "unreadable feature shard"):
            return _from_mapping(_as_dict(data))
    if path.suffix == ".h5":
        import h5py

        with open_regular_file(path, error=CorruptDataError) as handle:
            size = os.fstat(handle.fileno()).st_size
            with parser_guard(where, "unreadable feature shard"), h5py.File(handle, "r") as f:
                return _from_h5(f, size, where, samples)
    raise InputError(f"unknown feature file suffix {path.suffix!r}", path=where)


def _as_dict(data: Any) -> dict:
    if not isinstance(data, dict):
        raise TypeError(f"holds a {type(data).__name__}, not a dict")
    return data


def load_feature_bytes(data: bytes, where: str, *, samples: int | None = None) -> FeatureShard:
    """A feature shard from its bytes (fetched from object storage; checked by the caller), named ``where``: the
    format comes from its suffix. Nothing is unpickled (``weights_only=True``); ``samples`` as for
    ``load_feature_shard``."""
    import io

    suffix = os.path.splitext(where)[1]
    if suffix not in FEATURE_SUFFIXES.values():
        raise InputError(f"unknown feature file suffix {suffix!r}", path=where)
    if suffix == ".pt":
        loaded = load_weights_only(io.BytesIO(data), where, "unreadable feature shard")
        with parser_guard(where, "unreadable feature shard"):
            return _from_mapping(_as_dict(loaded))
    import h5py

    with parser_guard(where, "unreadable feature shard"), h5py.File(io.BytesIO(data), "r") as f:
        return _from_h5(f, len(data), where, samples)


def _from_mapping(data: dict) -> FeatureShard:
    return FeatureShard(data["features"], data["labels"], list(data["keys"]), data.get("views"), data.get("targets"))


def _from_h5(f: Any, file_bytes: int, where: str, samples: int | None) -> FeatureShard:
    """The datasets of an open ``h5py.File`` of layout ``H5_VERSION``; the optional ones (views, targets) as None
    when absent. Each is checked before it is read (``shards.formats.h5columns.checked_dataset``: a dataset, plain,
    declaring no more bytes than the file holds), and the keys against the rows: the manifest's ``samples`` when
    given, else the features' rows."""
    check_version(f, H5_VERSION, where, "feature shard", "run precompute-features again")
    checked = {name: checked_dataset(f, name, file_bytes, where, what=CORRUPT_H5)
               for name in ("features", "labels", "views", "targets") if name in ("features", "labels") or name in f}
    rows = samples if samples is not None else (checked["features"].shape or (0,))[0]
    keys = read_text_column(f, "key", rows, file_bytes, where, what=CORRUPT_H5)
    optional = {name: torch.from_numpy(checked[name][...]) if name in checked else None
                for name in ("views", "targets")}
    return FeatureShard(torch.from_numpy(checked["features"][...]), torch.from_numpy(checked["labels"][...]), keys,
                        **optional)


def verify_feature_file(path: str | os.PathLike, expected_bytes: int, expected_sha256: str) -> None:
    """Size, then sha256, of a feature file against its ``features.json`` entry (``ChecksumError`` naming it)."""
    size = os.path.getsize(path)
    if size != expected_bytes:
        raise ChecksumError(f"{size} bytes, features.json records {expected_bytes} (truncated or replaced)",
                            path=str(path))
    if sha256_file(path) != expected_sha256:
        raise ChecksumError("sha256 does not match features.json (corrupt or replaced)", path=str(path))


def load_checked(where: Any, info: Any, *, checked: bool = False) -> FeatureShard:
    """The feature shard at location ``where`` (``shards.transport.location``), its size and sha256 checked against
    its ``features.json`` entry ``info`` before a byte is parsed (``checked``: this process already checked this
    file). A local file is mmap'ed (paged in lazily); elsewhere it is fetched whole into memory, hashed on the way."""
    path = where.local_path()
    if path is not None:
        if not checked:
            verify_feature_file(path, info.bytes, info.sha256)
        return load_feature_shard(path, mmap=True, samples=info.samples)
    return load_feature_bytes(where.fetch_checked(info.bytes, info.sha256), where.text, samples=info.samples)


@dataclass(frozen=True)
class FeatureSpec:
    """What ``features.json`` promises about every shard's content."""

    features_dim: int
    dtype: str | None = None  # "float16", ...; None: not checked
    num_classes: int | None = None  # None: no classes (a regression table's labels are placeholders)
    views: int = 0
    targets: bool = False  # a float32 [N] ``targets`` entry (target_task(config) == "regression")

    @classmethod
    def of(cls, manifest: Any) -> "FeatureSpec":
        """What a ``FeatureManifest`` promises; a regression table has no classes (its labels are placeholders,
        with no range to check)."""
        return cls(manifest.features_dim, manifest.dtype, len(manifest.classes) or None, manifest.views,
                   target_task(manifest.config) == "regression")


def feature_shard_problems(shard: FeatureShard, samples: int, spec: FeatureSpec) -> list[str]:
    """Every way ``shard`` breaks what the manifest promises: shapes, dtypes, label range, targets, key types.

    One-line strings naming the first bad row and key, so ``shards verify`` can list them and the stream can raise
    the first one. Cheap: the label range is one min/max over an int64 column.
    """
    features, labels, keys = shard.features, shard.labels, shard.keys
    problems = []
    if not isinstance(features, torch.Tensor) or features.ndim != 2:
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        return [f"features shape {shape}, expected [N, {spec.features_dim}]"]
    if features.shape[0] != samples or len(keys) != samples:
        problems.append(f"{features.shape[0]} rows and {len(keys)} keys, features.json records {samples}")
    if features.shape[1] != spec.features_dim:
        problems.append(f"features shape {tuple(features.shape)}, expected [N, {spec.features_dim}]")
    if spec.dtype is not None and str(features.dtype).removeprefix("torch.") != spec.dtype:
        problems.append(f"dtype {features.dtype}, features.json says {spec.dtype}")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or tuple(labels.shape) != (samples,):
        what = f"{labels.dtype} {tuple(labels.shape)}" if isinstance(labels, torch.Tensor) else type(labels).__name__
        problems.append(f"labels are {what}, expected int64 [{samples}]")
    elif spec.num_classes is not None and samples:
        bad = ((labels < 0) | (labels >= spec.num_classes)).nonzero()
        if len(bad):
            row = int(bad[0])
            key = keys[row] if row < len(keys) and isinstance(keys[row], str) else "?"
            problems.append(f"label {int(labels[row])} at row {row} (key {key}) is outside [0, {spec.num_classes}) "
                            f"({len(bad)} such rows)")
    if not all(isinstance(k, str) for k in keys):
        problems.append("keys must all be strings")
    if spec.targets:
        problems.extend(_target_problems(shard, samples))
    if spec.views and (shard.views is None or tuple(shard.views.shape) != (samples, spec.views, spec.features_dim)):
        problems.append(f"views missing or not [{samples}, {spec.views}, {spec.features_dim}]")
    return problems


def _target_problems(shard: FeatureShard, samples: int) -> list[str]:
    targets = shard.targets
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.float32 or tuple(targets.shape) != (samples,):
        what = "missing" if targets is None else (f"{targets.dtype} {tuple(targets.shape)}"
                                                  if isinstance(targets, torch.Tensor) else type(targets).__name__)
        return [f"targets are {what}, expected float32 [{samples}] (features.json records a regression target)"]
    bad = (~torch.isfinite(targets)).nonzero()
    if len(bad):
        row = int(bad[0])
        key = shard.keys[row] if row < len(shard.keys) and isinstance(shard.keys[row], str) else "?"
        return [f"target {float(targets[row])} at row {row} (key {key}) is not a finite number "
                f"({len(bad)} such rows)"]
    return []


def check_feature_shard(shard: FeatureShard, path: str | os.PathLike, samples: int, spec: FeatureSpec) -> None:
    """Raise ``CorruptDataError`` naming the shard for the first way it breaks the manifest's promises."""
    problems = feature_shard_problems(shard, samples, spec)
    if problems:
        raise CorruptDataError(problems[0], path=str(path))


def stack_rows(shards: Sequence[FeatureShard]) -> FeatureShard:
    """Concatenate shards (for small caches held in memory)."""
    def joined(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        return torch.cat(tensors) if tensors and all(t is not None for t in tensors) else None

    return FeatureShard(
        torch.cat([s.features for s in shards]),
        torch.cat([s.labels for s in shards]),
        [k for s in shards for k in s.keys],
        joined([s.views for s in shards]),
        joined([s.targets for s in shards]),
    )
