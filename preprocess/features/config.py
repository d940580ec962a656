"""``FeatureConfig``: everything one ``precompute-features`` task needs, checked when it is made.

Why its own module: the run (``preprocess.features.featurize``), the consumer loop (``preprocess.features.consumer``)
and the decode share (``preprocess.features.decode_share``) all read it, and it names the dtypes the run can write
and the AMP modes it can run (``DTYPES``, ``AMP_MODES``); kept apart, each of them imports it and none imports
another to reach it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shards.atomic import check_local_output
from shards.door.locations import check_dataset_dir
from shards.errors import InputError
from shards.formats.feature_names import FEATURE_SUFFIXES
from shards.stream.options import DECODES
from shards.transport.location import Location, locate
from shards.transport.s3 import S3Options

DTYPES = {"float16": torch.float16, "float32": torch.float32}
AMP_MODES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}


@dataclass(frozen=True)
class FeatureConfig:
    """Everything one ``precompute-features`` task needs; transform fields left None come from the weights."""

    data_dir: Path | str  # a local folder, or an s3://bucket/prefix (``source``: where, as a location)
    out_dir: Path
    backbone: str = "resnet50"
    weights: str = "none"
    seed: int = 0
    resize: int | None = None
    crop: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    interpolation: str | None = None
    views: int = 0
    augment: bool = False
    dtype: str = "float16"
    storage: str = "pt"
    device: str = "auto"
    amp: str = "auto"
    decode: str = "fast"
    device_share: float = 1.0  # with decode="device": the share of images decoded there; workers do the rest
    decode_check: int = 256  # with decode="device": 1 in N images decoded again on the CPU and compared (0: off)
    batch_size: int = 64
    workers: int = 2
    splits: tuple[str, ...] | None = None
    task_index: int = 0
    num_tasks: int = 1
    overwrite: bool = False
    quiet: bool = False
    storage_options: Any = None  # S3Options (or a mapping of its fields) for an s3:// data_dir
    cache: Any = None  # a shards.cache.node.ShardCache: keep fetched image shards on this node's disk
    shard_source: Path | str | None = None  # where the shards are when not beside dataset.json (adopted tars)
    memory_budget: int | None = None  # bytes the loader holds in flight (None: shards.loader.budget's default)
    source: Location = field(init=False, repr=False, compare=False)
    shards_at: Location | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_local_output(self.out_dir)  # before Path(), which turns s3://b/x into s3:/b/x
        places = [self.data_dir] + ([] if self.shard_source is None else [self.shard_source])
        if any(locate(place).uses_storage_options for place in places):
            object.__setattr__(self, "storage_options", S3Options.from_mapping(self.storage_options))
        object.__setattr__(self, "source", locate(self.data_dir, storage_options=self.storage_options))
        object.__setattr__(self, "shards_at", None if self.shard_source is None
                           else locate(self.shard_source, storage_options=self.storage_options))
        check_dataset_dir(recorded(self.source))  # what features.json may record: a local folder or s3:// prefix
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        choices = {"dtype": DTYPES, "storage": FEATURE_SUFFIXES, "decode": DECODES,
                   "amp": (*AMP_MODES, "auto")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise InputError(f"{name} {getattr(self, name)!r} is not one of {sorted(allowed)}")
        if self.batch_size < 1 or self.workers < 0 or self.views < 0:
            raise InputError(f"batch_size {self.batch_size} must be >= 1, workers {self.workers} and "
                             f"views {self.views} >= 0")
        if bool(self.views) != self.augment:
            raise InputError("--views K and --augment go together: K augmented views per image need both")
        if self.memory_budget is not None and (type(self.memory_budget) is not int or self.memory_budget < 1):
            raise InputError(f"memory_budget {self.memory_budget!r} must be a positive number of bytes")
        if self.decode_check < 0:
            raise InputError(f"decode_check {self.decode_check} must be >= 0 (1 in N images checked; 0: off)")
        if not 0.0 <= self.device_share <= 1.0:
            raise InputError(f"device_share {self.device_share} must be between 0 and 1")
        if self.device_share < 1.0 and (self.decode != "device" or self.augment):
            raise InputError(f"device_share {self.device_share} splits --decode device's decoding with the workers; "
                             f"it needs decode 'device' (not {self.decode!r}) and no --augment")
        if self.num_tasks < 1 or not 0 <= self.task_index < self.num_tasks:
            raise InputError(f"task index {self.task_index} is not in [0, {self.num_tasks})")
        if _is_folder(self.source, self.out_dir):
            raise InputError("--out must differ from the dataset folder", path=str(self.out_dir))
        if self.shards_at is not None and _is_folder(self.shards_at, self.out_dir):
            raise InputError("--out must differ from the --source folder", path=str(self.out_dir))


def recorded(source: Location) -> str:
    """``dataset_dir`` as this folder records it: a local folder resolved (symlinks followed, as every run has
    recorded it: a rerun must find the same), any other location as given, without a trailing ``/``."""
    path = source.local_path()
    return str(path.resolve()) if path is not None else source.record().rstrip("/")


def _is_folder(where: Location, folder: Path) -> bool:
    """Whether ``where`` is ``folder`` on this machine (symlinks followed)."""
    path = where.local_path()
    return path is not None and path.resolve() == folder.resolve()
