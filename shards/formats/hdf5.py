"""HDF5 shards: the same samples as the tar shards, for sites that prefer one file format they know.

Layout of one ``<split>-NNNNNN.h5`` file (plain h5py reads it)::

    data                    uint8[total_bytes]  every sample's encoded bytes, concatenated (contiguous)
    offsets                 int64[N + 1]        sample i is data[offsets[i]:offsets[i + 1]]
    labels                  int64[N]
    key_bytes, key_ends     text[N]             the keys
    ext_bytes, ext_ends     text[N]             "jpg", "png", ...
    meta_bytes, meta_ends   text[N]             the sample's JSON metadata
    attrs    classes (list of str), format = "shardcache.hdf5", version = 2

A text column is a uint8 blob and uint64 ends, with no variable-length data for the reader to follow
(``shards.formats.h5columns``; version 1 held variable-length strings, and is refused, never read).

One flat byte array with offsets (rather than a variable-length ``uint8`` dataset) reads a whole shard in one
sequential ``read`` instead of one small HDF5 read per sample, and is just as easy to read without shardcache.

A shard is untrusted bytes handed to a third-party parser, so it goes through the one door (``shards.door.bounded_read``):
a local file is opened by ``open_regular_file`` (a FIFO would block HDF5's own ``open`` forever) and h5py reads
that handle; h5py runs inside ``parser_guard``; and every dataset's kind, rank, dtype and declared size is checked
before any is read (a shape of 10**12 in a 1 KB file is refused, never allocated).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence

import numpy as np

from shards.atomic import atomic_output, sha256_file
from shards.door.bounded_read import open_regular_file, parser_guard
from shards.errors import CorruptDataError
from shards.formats.h5columns import VERSION_ATTR, check_version, read_text_column, write_text_column
from shards.formats.sample import RawSample

HDF5_FORMAT = "shardcache.hdf5"
HDF5_VERSION = 2
TEXT_COLUMNS = ("key", "ext", "meta")  # one row per sample, beside ``labels``, ``offsets`` (one more) and ``data``
UNREADABLE = "unreadable HDF5 shard"
CORRUPT = "corrupt HDF5 shard"


def _h5py():
    import h5py  # imported lazily: tar-only users never pay for it

    return h5py


class Hdf5ShardWriter:
    """Collect one shard's samples in memory (a shard is bounded by --max-bytes), then write it atomically."""

    suffix = ".h5"

    def __init__(self, path: str | os.PathLike, classes: Sequence[str] = ()):
        self.path = Path(path)
        self.classes = list(classes)
        self.samples = 0
        self.sha256 = ""
        self.bytes = 0
        self._rows: list[RawSample] = []

    def __enter__(self) -> "Hdf5ShardWriter":
        return self

    def write(self, sample: RawSample) -> None:
        self._rows.append(sample)
        self.samples += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            return
        h5py = _h5py()
        rows = self._rows
        sizes = np.fromiter((len(r.data) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        data = np.frombuffer(b"".join(r.data for r in rows), dtype=np.uint8)
        text = h5py.string_dtype("utf-8")
        with atomic_output(self.path) as tmp:
            # track_times=False keeps the file byte-identical across runs.
            with h5py.File(tmp, "w", track_order=True) as f:
                f.attrs["format"] = HDF5_FORMAT
                f.attrs[VERSION_ATTR] = HDF5_VERSION
                f.attrs.create("classes", np.array(self.classes, dtype=object), dtype=text)
                # Contiguous: chunks of 1 MiB allocated the last one whole, so shards went past --max-bytes.
                f.create_dataset("data", data=data, track_times=False)
                f.create_dataset("offsets", data=offsets, track_times=False)
                f.create_dataset("labels", data=np.array([r.label for r in rows], dtype=np.int64), track_times=False)
                write_text_column(f, "key", (r.key for r in rows))
                write_text_column(f, "ext", (r.ext for r in rows))
                write_text_column(f, "meta", (r.meta.decode("utf-8") for r in rows))
        self.sha256 = sha256_file(self.path)
        self.bytes = self.path.stat().st_size
        self._rows = []


def iter_hdf5_shard(path: str | os.PathLike | BinaryIO, start: int = 0, stop: int | None = None, *,
                    resync: bool = False, where: str | None = None) -> Iterator[RawSample | CorruptDataError]:
    """Yield samples ``start:stop`` of one HDF5 shard, reading their bytes in one contiguous slice.

    The file is untrusted: anything h5py cannot read, and any layout that does not hold together (columns of other
    lengths, more data than the file could store uncompressed, which is how the writer stores it) is a
    ``CorruptDataError`` naming the shard. A sample whose bytes the offsets do not locate (``_unlocated``) costs
    that sample: with ``resync`` it is yielded as its ``CorruptDataError`` and reading goes on, otherwise it
    raises. ``path`` may also be a seekable binary file object (``shards.transport.s3shards.S3File``: a shard on
    object storage; bytes in memory), ``where`` then naming it in messages.
    """
    h5py = _h5py()
    where = where or _where(path)
    with _opened(path, where) as source, parser_guard(where, UNREADABLE):
        file_bytes = source.seek(0, os.SEEK_END)
        with h5py.File(source, "r") as f:
            columns = _checked_columns(f, file_bytes, where)
            offsets = np.asarray(columns["offsets"][...])
            n = len(offsets) - 1
            stop = n if stop is None else min(stop, n)
            if start >= stop:
                return
            data = columns["data"]
            data_bytes = int(data.shape[0])
            unlocated = _unlocated(offsets, data_bytes)[start:stop]
            labels = columns["labels"][start:stop]
            keys, exts, meta = (read_text_column(f, name, n, file_bytes, where, start, stop, what=CORRUPT)
                                for name in TEXT_COLUMNS)
            located = np.flatnonzero(~unlocated) + start
            base = int(offsets[located].min()) if len(located) else 0
            blob = data[base : int(offsets[located + 1].max())].tobytes() if len(located) else b""
    for i in range(stop - start):
        lo = int(offsets[start + i])
        hi = int(offsets[start + i + 1])
        if unlocated[i]:
            error = CorruptDataError(f"corrupt HDF5 shard: offsets {lo}, {hi} of sample {start + i} do not locate "
                                     f"its bytes in the {data_bytes}-byte data", path=where, key=str(keys[i]))
            if not resync:
                raise error
            yield error
            continue
        yield RawSample(keys[i], blob[lo - base:hi - base], exts[i], int(labels[i]), meta[i].encode("utf-8"))


def _unlocated(offsets: np.ndarray, data_bytes: int) -> np.ndarray:
    """Per sample, whether the offsets fail to locate its bytes: an offset outside the data (the first must be 0),
    or one on either side of a step backwards. Of such a pair only the odd one out is blamed when removing it alone
    mends the order, so one bad offset costs the two samples it bounds, not its neighbours too."""
    n = len(offsets) - 1
    suspect = (offsets < 0) | (offsets > data_bytes)
    suspect[0] |= offsets[0] != 0
    for j in np.flatnonzero(offsets[1:] < offsets[:-1]).tolist():
        before = offsets[j - 1] if j > 0 else 0
        after = offsets[j + 2] if j + 2 <= n else data_bytes
        without_left = before <= offsets[j + 1]  # dropping offsets[j] mends the order
        without_right = offsets[j] <= after
        suspect[j] |= without_left or not without_right
        suspect[j + 1] |= without_right or not without_left
    return suspect[:-1] | suspect[1:]


HDF5_WINDOW = 256  # samples per read when streaming a slice: bounded memory, still one contiguous read per window


def iter_hdf5_slice(path: str | os.PathLike, start: int = 0, stop: int | None = None, *,
                    sha256: str | None = None, resync: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Samples ``start:stop`` read in windows of ``HDF5_WINDOW`` (the streaming reader's access pattern).

    ``sha256`` is accepted for a uniform reader signature and not checked: HDF5 reads are not sequential over the
    file's bytes, so hashing would cost a second read (``shards verify`` checks it). ``resync`` as in
    ``iter_hdf5_shard``."""
    if stop is None:
        stop = shard_length(path)
    for lo in range(start, stop, HDF5_WINDOW):
        yield from iter_hdf5_shard(path, lo, min(stop, lo + HDF5_WINDOW), resync=resync)


def shard_length(path: str | os.PathLike | BinaryIO) -> int:
    """Samples in an HDF5 shard, from its offsets (nothing else is read)."""
    where = _where(path)
    with _opened(path, where) as source, parser_guard(where, UNREADABLE):
        file_bytes = source.seek(0, os.SEEK_END)
        with _h5py().File(source, "r") as f:
            return _checked_columns(f, file_bytes, where)["offsets"].shape[0] - 1


def _where(path) -> str:
    return str(getattr(path, "name", path)) if hasattr(path, "read") else str(path)


@contextmanager
def _opened(path: str | os.PathLike | BinaryIO, where: str) -> Iterator[BinaryIO]:
    """A shard given by its path, opened through the one door (a regular file only, else ``CorruptDataError``
    naming it); a file object as it is."""
    if hasattr(path, "read"):
        yield path
        return
    with open_regular_file(path, error=CorruptDataError) as handle:
        yield handle


def _checked_columns(f: Any, file_bytes: int, where: str) -> dict[str, Any]:
    """The shard's datasets by name, each checked before any is read: the layout version, present and a dataset,
    1-D, ``offsets`` and ``labels`` integers, one label per sample, and ``offsets`` and ``data`` no larger than
    the file could store uncompressed, as the writer stores them (so a declared shape never allocates more than
    the file's size). The text columns are checked as they are read (``read_text_column``)."""
    check_version(f, HDF5_VERSION, where, "HDF5 shard", "pack it again")
    found = {name: f.get(name) for name in ("data", "offsets", "labels")}
    missing = [name for name, dataset in found.items() if not isinstance(dataset, _h5py().Dataset)]
    problem = None
    if missing:
        problem = f"no dataset {missing[0]!r}"
    elif any(len(found[name].shape) != 1 for name in found) or not found["offsets"].shape[0] \
            or found["offsets"].dtype.kind not in "iu" or found["labels"].dtype.kind not in "iu":
        problem = "offsets, labels or data are not 1-D integer arrays"
    elif found["data"].shape[0] > file_bytes:
        problem = f"data claims {found['data'].shape[0]} bytes, more than the {file_bytes}-byte file holds"
    elif found["offsets"].shape[0] * found["offsets"].dtype.itemsize > file_bytes:
        problem = f"offsets claim {found['offsets'].shape[0]} entries, more than the {file_bytes}-byte file holds"
    else:
        n = found["offsets"].shape[0] - 1
        if found["labels"].shape != (n,):
            problem = f"{n} samples in offsets, but labels of shape {found['labels'].shape}"
    if problem is not None:
        raise CorruptDataError(f"{CORRUPT}: {problem}", path=where)
    return found
