"""HDF5 shards: the same samples as the tar shards, for sites that prefer one file format they know.

Layout of one ``<split>-NNNNNN.h5`` file (plain h5py reads it)::

    data     uint8[total_bytes]   every sample's encoded bytes, concatenated (chunked, contiguous reads)
    offsets  int64[N + 1]         sample i is data[offsets[i]:offsets[i + 1]]
    labels   int64[N]
    keys     str[N]
    exts     str[N]               "jpg", "png", ...
    meta     str[N]               the sample's JSON metadata
    attrs    classes (list of str), format = "shardcache.hdf5", version = 1

One flat byte array with offsets (rather than a variable-length ``uint8`` dataset) reads a whole shard in one
sequential ``read`` instead of one small HDF5 read per sample, and is just as easy to read without shardcache.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from shards.atomic import atomic_output, sha256_file
from shards.errors import CorruptDataError
from shards.formats.sample import RawSample

HDF5_FORMAT = "shardcache.hdf5"
CHUNK_BYTES = 1 << 20


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
                f.attrs["version"] = 1
                f.attrs.create("classes", np.array(self.classes, dtype=object), dtype=text)
                chunk = (max(1, min(CHUNK_BYTES, len(data))),)
                f.create_dataset("data", data=data, chunks=chunk if len(data) else None, track_times=False)
                f.create_dataset("offsets", data=offsets, track_times=False)
                f.create_dataset("labels", data=np.array([r.label for r in rows], dtype=np.int64), track_times=False)
                for name, values in (
                    ("keys", [r.key for r in rows]),
                    ("exts", [r.ext for r in rows]),
                    ("meta", [r.meta.decode("utf-8") for r in rows]),
                ):
                    f.create_dataset(name, data=np.array(values, dtype=object), dtype=text, track_times=False)
        self.sha256 = sha256_file(self.path)
        self.bytes = self.path.stat().st_size
        self._rows = []


def iter_hdf5_shard(path: str | os.PathLike, start: int = 0, stop: int | None = None, *,
                    resync: bool = False) -> Iterator[RawSample | CorruptDataError]:
    """Yield samples ``start:stop`` of one HDF5 shard, reading their bytes in one contiguous slice.

    The file is untrusted: anything h5py cannot read, and any layout that does not hold together (columns of other
    lengths, more data than the file could store uncompressed, which is how the writer stores it) is a
    ``CorruptDataError`` naming the shard. A sample whose bytes the offsets do not locate (``_unlocated``) costs
    that sample: with ``resync`` it is yielded as its ``CorruptDataError`` and reading goes on, otherwise it
    raises. ``path`` may also be a seekable binary file object (``shards.formats.s3shards.S3File``: a shard on
    object storage).
    """
    h5py = _h5py()
    where = _where(path)
    try:
        file_bytes = _file_bytes(path)
        with h5py.File(path, "r") as f:
            offsets = np.asarray(f["offsets"][...])
            n = len(offsets) - 1
            data = f["data"]
            _check_layout(f, offsets, data.shape, file_bytes, where)
            stop = n if stop is None else min(stop, n)
            if start >= stop:
                return
            data_bytes = int(data.shape[0])
            unlocated = _unlocated(offsets, data_bytes)[start:stop]
            labels = f["labels"][start:stop]
            keys = f["keys"].asstr()[start:stop]
            exts = f["exts"].asstr()[start:stop]
            meta = f["meta"].asstr()[start:stop]
            located = np.flatnonzero(~unlocated) + start
            base = int(offsets[located].min()) if len(located) else 0
            blob = data[base : int(offsets[located + 1].max())].tobytes() if len(located) else b""
    except (FileNotFoundError, CorruptDataError):
        raise
    except Exception as exc:  # h5py raises OSError, KeyError, ValueError, TypeError, ... for a damaged file
        raise CorruptDataError(f"unreadable HDF5 shard ({type(exc).__name__}: {exc})", path=where) from exc
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
        yield RawSample(str(keys[i]), blob[lo - base:hi - base], str(exts[i]), int(labels[i]),
                        str(meta[i]).encode("utf-8"))


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


def shard_length(path: str | os.PathLike) -> int:
    """Samples in an HDF5 shard, from its offsets (nothing else is read)."""
    try:
        with _h5py().File(path, "r") as f:
            return max(0, int(f["offsets"].shape[0]) - 1)
    except FileNotFoundError:
        raise
    except Exception as exc:  # a damaged file: see iter_hdf5_shard
        raise CorruptDataError(f"unreadable HDF5 shard ({type(exc).__name__}: {exc})", path=_where(path)) from exc


def _where(path) -> str:
    return str(getattr(path, "name", path)) if hasattr(path, "read") else str(path)


def _file_bytes(path) -> int:
    """The size of a shard given as a path or as a seekable file object."""
    if hasattr(path, "read"):
        return path.seek(0, os.SEEK_END)
    return os.path.getsize(path)


def _check_layout(f, offsets: np.ndarray, data_shape: tuple, file_bytes: int, where: str) -> None:
    n = len(offsets) - 1
    problem = None
    if offsets.ndim != 1 or n < 0 or offsets.dtype.kind not in "iu" or len(data_shape) != 1:
        problem = "offsets or data are not 1-D integer arrays"
    elif data_shape[0] > file_bytes:
        problem = f"data claims {data_shape[0]} bytes, more than the {file_bytes}-byte file holds"
    else:
        lengths = {name: f[name].shape for name in ("labels", "keys", "exts", "meta")}
        if any(shape != (n,) for shape in lengths.values()):
            problem = f"{n} samples in offsets, but column shapes {lengths}"
    if problem is not None:
        raise CorruptDataError(f"corrupt HDF5 shard: {problem}", path=where)
