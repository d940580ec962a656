"""Where a source sample's bytes are: a whole file, or a member of a container file.

An ImageFolder or list source names one file per sample. Parquet files, ``datasets.save_to_disk`` Arrow files and
WebDataset tars hold many samples each, so a sample there is a *member*: its relative path is its container's
relative path, ``#`` and its place in it (``data/train-00000-of-00001.parquet#17``: row 17; ``shard-003.tar#cat_12``:
the tar sample keyed ``cat_12``), and the ``offset`` column of ``preprocess.pack.sources.columns`` says where the
bytes start (the row number, or the byte of the tar sample's first header). That one address serves every stage:
the key (derived from it, or a tar's own key kept), the plan digest, the source index that ``--append`` diffs,
and the packer, which reads a shard's members grouped by container, opening each container once per shard job
(``preprocess.pack.sources.registry.fetch_members``).

``MemberSpec`` is what the packer needs beyond the address to read a member (which column holds the image, which
columns become metadata); it is recorded in the plan, so it is part of the dataset's identity. It also carries the
most bytes one read of a container may decode (``--max-bytes``, which the plan records as such).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from shards.errors import InputError
from shards.units import human_bytes

MEMBER_MARK = "#"
# Fields every packed sample's ``<key>.json`` holds (``preprocess.pack.validate.sample_meta``): a source column or
# JSON field of the same name cannot also be kept as metadata.
RESERVED_META = ("path", "class", "width", "height", "mode", "format")
# The most one read of a container may decode (a Parquet row group, an Arrow record batch) unless the scan is given
# ``--max-bytes``: the option's default, the bytes of a shard, which the packer holds anyway.
DEFAULT_MAX_BYTES = 256 << 20


def too_large(size: int, max_bytes: int) -> str:
    """The skip reason of a sample (a file, a tar sample's members) larger than ``--max-bytes``: judged by the size
    its file system or header declares, before any byte is read, since the packer would hold it whole."""
    return f"too large: {human_bytes(size)}, more than --max-bytes ({human_bytes(max_bytes)})"


def member_path(container_rel: str, place: int | str) -> str:
    """The relative path of the member at ``place`` (a row number or a tar key) of a container file."""
    return f"{container_rel}{MEMBER_MARK}{place}"


def container_of(path: str) -> str:
    """The container part of a member's (relative or absolute) path."""
    return path.rpartition(MEMBER_MARK)[0]


def member_key(rel_path: str) -> str:
    """The key of a member that keeps its own (a WebDataset sample's key, checked when scanned)."""
    return rel_path.rpartition(MEMBER_MARK)[2]


@dataclass(frozen=True)
class SourceFields:
    """Where a container source keeps each sample's image and label (``--image-column``, ``--label-column`` for
    Parquet and Arrow; ``--label-member`` or ``--label-field`` of the ``.json`` member for WebDataset tars)."""

    image_column: str = "image"
    label_column: str = "label"
    label_member: str | None = None
    label_field: str | None = None

    def __post_init__(self) -> None:
        if self.label_member is not None and self.label_field is not None:
            raise InputError("give --label-member or --label-field, not both")
        for name in ("image_column", "label_column", "label_member", "label_field"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise InputError(f"--{name.replace('_', '-')} is empty")


@dataclass(frozen=True)
class MemberSpec:
    """How to read members of a source's containers: ``container`` is ``parquet``, ``arrow`` (an Arrow IPC stream
    file, as ``datasets.save_to_disk`` writes) or ``tar``."""

    container: str
    image_column: str | None = None  # parquet/arrow: the column with the image cells
    meta_columns: tuple[str, ...] = ()  # parquet/arrow: scalar columns kept as per-sample metadata
    # parquet/arrow: the most one row group may decode (``--max-bytes``, recorded in the plan as such)
    max_bytes: int = field(default=DEFAULT_MAX_BYTES, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"container": self.container, "image_column": self.image_column,
                "meta_columns": list(self.meta_columns)}


class MemberBytes(NamedTuple):
    """What a member read gave: the image's bytes, or the reason it cannot be packed (a skip reason)."""

    data: bytes | None
    problem: str | None = None
    meta: Mapping[str, Any] | None = None  # extra ``<key>.json`` fields (scalar columns of a Parquet row)
    extra: tuple[tuple[str, bytes], ...] = ()  # other members to keep (a tar sample's .txt, its own .json...)
