"""The raw sample every storage reader yields and every writer takes: encoded bytes, never decoded here."""

from __future__ import annotations

from typing import NamedTuple

# Extensions the packer stores, lower case, as tar member suffixes; the order is webdataset's ``to_tuple`` order.
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")


class RawSample(NamedTuple):
    """One packed sample. A NamedTuple, not a dict: it is created once per sample in the hot loop."""

    key: str
    data: bytes  # the encoded image file, as stored
    ext: str  # "jpg", "png", ...: how the bytes are encoded
    label: int
    meta: bytes = b""  # the sample's JSON metadata (source path, class, size, mode), as stored
    # Other members kept with the sample, as ``(extension, bytes)`` (a WebDataset source's .txt...): tar shards
    # write them after the json member; readers pass over them.
    extra: tuple[tuple[str, bytes], ...] = ()


def label_problem(label: int, num_classes: int, shard_counts: tuple[int, ...] | None = None) -> str | None:
    """Why a label read from a shard cannot be right, or None: outside ``[0, num_classes)`` (a flipped bit in a
    ``.cls`` member or an HDF5 ``labels`` value), or a class of which the manifest counts no sample in this shard
    (``ShardInfo.class_counts``, where recorded). The one rule the stream and ``shards verify`` apply."""
    if not 0 <= label < num_classes:
        return f"label {label} is outside [0, {num_classes})"
    if shard_counts is not None and (label >= len(shard_counts) or shard_counts[label] == 0):
        return f"label {label} is a class the manifest counts no sample of in this shard"
    return None
