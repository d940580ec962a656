"""Every kind of packing source, in one table: how each is recognised and scanned (``SOURCE_KINDS``), and how the
members of each container format are read back (``READERS``).

This is the one place kinds are listed: ``scan_source`` asks the table which kind an input is, ``SourceScan`` and
the packer ask it what a kind's samples are like, and the names are what the manifest records as
``source.kind``. A new kind is one module (its recogniser and its scan, on the contract of
``preprocess.pack.sources.kind``) and one entry here.

Recognition tries the kinds in the table's order and takes the first that matches, so the more particular
layouts come first: a brace pattern is read as tars before anything asks the disk, a ``save_to_disk`` folder
before a folder holding Parquet files, the train/val/test layout before a plain ImageFolder tree (which takes
any folder left).

Reading members back: the packer asks for the bytes of every sample of one shard (``fetch_members``); the
samples are grouped by their container (``preprocess.pack.sources.members.container_of``), that container
format's reader is asked for them, each container opened once, and the results come back in the shard's order.
A shard's source bytes are held while it is written: at most about ``--max-bytes`` (plus one row group).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterator, Sequence

from preprocess.pack.sources.columns import SourceSample
from preprocess.pack.sources.imagefolder import is_split_trees, is_tree, scan_split_trees, scan_tree
from preprocess.pack.sources.kind import SourceKind
from preprocess.pack.sources.lists import is_csv_list, is_jsonl_list, scan_csv_list, scan_jsonl_list
from preprocess.pack.sources.members import MemberBytes, MemberSpec, SourceFields, container_of
from preprocess.pack.sources.parquet import (fetch_table_members, is_parquet, is_save_to_disk, scan_parquet,
                                             scan_save_to_disk)
from preprocess.pack.sources.tars import fetch_tar_members, is_tar_pattern, scan_tars
from shards.errors import InputError, MissingInputError

TABLE_FIELDS = frozenset({"image_column", "label_column"})

SOURCE_KINDS: tuple[SourceKind, ...] = (
    SourceKind("webdataset", title="WebDataset", looks_like=".tar files (a path, or a pattern 'shard-{000..099}.tar')",
               recognise=is_tar_pattern, scan=scan_tars, fields=frozenset({"label_member", "label_field"}),
               kept_keys=True, extra_members=True),
    SourceKind("hf-arrow", title="save_to_disk", looks_like="a datasets.save_to_disk folder",
               recognise=is_save_to_disk, scan=scan_save_to_disk, fields=TABLE_FIELDS),
    SourceKind("parquet", title="Parquet", looks_like=".parquet files (a file, or a folder of them)",
               recognise=is_parquet, scan=scan_parquet, fields=TABLE_FIELDS),
    SourceKind("imagefolder-splits", title="train/val/test", looks_like="train/val/test trees",
               recognise=is_split_trees, scan=scan_split_trees, base_is_root=True),
    SourceKind("imagefolder", title="ImageFolder", looks_like="an ImageFolder tree",
               recognise=is_tree, scan=scan_tree, base_is_root=True),
    SourceKind("jsonl", title="JSONL", looks_like="a .jsonl or .ndjson list",
               recognise=is_jsonl_list, scan=scan_jsonl_list),
    SourceKind("csv", title="CSV", looks_like="a .csv list", recognise=is_csv_list, scan=scan_csv_list),
)
_BY_NAME = {kind.name: kind for kind in SOURCE_KINDS}

Reader = Callable[[MemberSpec, str, Sequence[tuple[int, SourceSample]]], Iterator[tuple[int, MemberBytes]]]
READERS: dict[str, Reader] = {"parquet": fetch_table_members, "arrow": fetch_table_members, "tar": fetch_tar_members}


def source_kind(name: str) -> SourceKind:
    """The kind a scan or a manifest names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown source kind {name!r} (known: {', '.join(_BY_NAME)})") from None


def recognise(source: str) -> SourceKind:
    """The first kind whose recogniser takes ``source``; a source none takes, or one that cannot even be looked
    at (a name too long, a folder that cannot be listed), is one ``InputError`` naming it."""
    where = str(Path(source))
    try:
        kind = next((kind for kind in SOURCE_KINDS if kind.recognise(source)), None)
        exists = kind is not None or Path(source).exists()
    except OSError as exc:
        raise InputError(f"cannot read ({exc.strerror or exc})", path=where) from None
    if kind is not None:
        return kind
    if not exists:
        raise MissingInputError("no such file or folder", path=where)
    looks = "; ".join(other.looks_like for other in SOURCE_KINDS)
    raise InputError(f"not a source of a known kind ({looks})", path=where)


def check_fields(kind: SourceKind, fields: SourceFields, where: str) -> None:
    """Refuse the ``SourceFields`` given that ``kind`` does not read: silently ignored, they would pack something
    other than what was asked. Named with the kinds that do read them, alphabetically."""
    unread = [each.name for each in dataclasses.fields(fields) if each.name not in kind.fields]
    if all(getattr(fields, name) == getattr(SourceFields(), name) for name in unread):
        return
    flags = [f"--{name.replace('_', '-')}" for name in unread]
    readers = sorted((other.title for other in SOURCE_KINDS if other.fields & set(unread)), key=str.lower)
    raise InputError(f"{_spelled(flags)} apply to {_spelled(readers)} sources, not to {kind.title} sources",
                     path=where)


def _spelled(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def fetch_members(spec: MemberSpec, samples: Sequence[SourceSample]) -> list[MemberBytes]:
    """What each of ``samples`` holds, in their order; containers read in sorted order, each once."""
    by_container: dict[str, list[tuple[int, SourceSample]]] = {}
    for position, sample in enumerate(samples):
        by_container.setdefault(container_of(sample.abs_path), []).append((position, sample))
    found: list[MemberBytes | None] = [None] * len(samples)
    read = READERS[spec.container]
    for container in sorted(by_container):
        for position, member in read(spec, container, by_container[container]):
            found[position] = member
    return [member if member is not None else MemberBytes(None, "not found in its file") for member in found]
