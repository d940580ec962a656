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
