"""The storage registry: one entry per image-shard format, so callers never branch on format names.

Each entry says how to write a shard, read it whole (checks, featurising, appends), read one slice of it (the
streaming reader), and read it as a stream from a non-seekable location (``None`` where the format cannot be).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from shards.errors import InputError
from shards.formats.hdf5 import Hdf5ShardWriter, iter_hdf5_shard, iter_hdf5_slice
from shards.formats.sample import RawSample
from shards.formats.tar import TarShardWriter, iter_tar_shard
from shards.formats.tarseek import iter_tar_slice, iter_tar_stream


@dataclass(frozen=True)
class Storage:
    name: str
    suffix: str
    writer: type
    read: Callable[..., Iterator[RawSample]]  # (path) -> every sample
    read_slice: Callable[..., Iterator[RawSample]]  # (path, start, stop, *, sha256=None) -> samples start:stop
    read_stream: Callable[..., Iterator[RawSample]] | None  # (binary stream, where) -> every sample
    indexed: bool = False  # read_slice takes ``offsets=`` (a per-sample byte index, see shards.formats.tarindex)


STORAGES: dict[str, Storage] = {
    "tar": Storage("tar", ".tar", TarShardWriter, iter_tar_shard, iter_tar_slice, iter_tar_stream,
                   indexed=True),
    "hdf5": Storage("hdf5", ".h5", Hdf5ShardWriter, iter_hdf5_shard, iter_hdf5_slice, None),
}


def get_storage(name: str) -> Storage:
    try:
        return STORAGES[name]
    except KeyError:
        raise InputError(f"unknown storage {name!r}; choose one of {sorted(STORAGES)}") from None


def shard_name(split: str, index: int, storage: str) -> str:
    """``train-000012.tar``: the name every stage expects for shard ``index`` of ``split``."""
    return f"{split}-{index:06d}{get_storage(storage).suffix}"
