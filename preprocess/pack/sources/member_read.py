"""Reading a shard's members: grouped by container file, each container opened once per shard job, in order.

The packer asks for the bytes of every sample of one shard (``fetch_members``); this groups the samples by their
container (``preprocess.pack.sources.members.container_of``), asks that container format's reader for them (the registry
below, one reader per format, beside its scanner), and hands the results back in the shard's order. A shard's
source bytes are held while it is written: at most about ``--max-bytes`` (plus one row group being read).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from preprocess.pack.sources.members import MemberBytes, MemberSpec, container_of
from preprocess.pack.sources.columns import SourceSample
from preprocess.pack.sources.parquet import fetch_table_members
from preprocess.pack.sources.tars import fetch_tar_members

Reader = Callable[[MemberSpec, str, Sequence[tuple[int, SourceSample]]], Iterator[tuple[int, MemberBytes]]]
READERS: dict[str, Reader] = {"parquet": fetch_table_members, "arrow": fetch_table_members, "tar": fetch_tar_members}


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
