"""The image-shard dataset: tar or HDF5 shards, local, behind the node cache, on ``s3://``, ``http(s)://`` or ``pipe:``,
read into ``RawSample`` and decoded by a pluggable ``decoder(sample, seed)``.

Everything about order, epochs, resume and errors lives in the base class (``shards.stream.dataset``); this module
holds only how image bytes are reached and turned into outputs, and the label check every sample passes before
anything uses its label (``checked_labels``, which also maps a mixture's class lists).
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from shards.cache.cached_shards import CachedShards
from shards.errors import CorruptDataError, InputError, MissingInputError
from shards.formats.locations import is_remote
from shards.formats.remote import open_remote
from shards.formats.s3 import is_s3
from shards.formats.sample import RawSample, label_problem
from shards.formats.storage import get_storage
from shards.formats.tarindex import load_local_index
from shards.image.decode import ImageDecoder
from shards.manifest import SplitInfo
from shards.stream.dataset import ShardDataset, StreamConfig
from shards.stream.plan import ShardSlice

log = logging.getLogger(__name__)


def checked_labels(samples: Iterator[Any], where: str, num_classes: int, *,
                   shard_counts: Sequence[int] | None = None, mapping: Any = None,
                   resync: bool = False) -> Iterator[Any]:
    """Samples whose labels pass ``label_problem`` (``num_classes``: the source's classes, ``len(mapping)``, when
    ``mapping`` takes them onto a mixture's combined classes, ``label_maps``); a bad one is a ``CorruptDataError``
    naming shard and key, yielded in the sample's place with ``resync`` (``CorruptDataError`` items pass), else
    raised. Checked before anything uses the label: class weights index by it, a loss fails on it."""
    for sample in samples:
        if isinstance(sample, RawSample):
            problem = label_problem(sample.label, num_classes, shard_counts)
            if problem is not None:
                sample = CorruptDataError(problem, path=where, key=sample.key)
            elif mapping is not None:
                sample = sample._replace(label=int(mapping[sample.label]))
        if isinstance(sample, CorruptDataError) and not resync:
            raise sample
        yield sample


MERGE_GAP = 32  # unwanted rows a read may pass over (shards.stream.plan.covering_reads)


class ImageShardDataset(ShardDataset):
    """Image shards (tar or HDF5, local, ``http(s)://`` or ``pipe:``) -> ``(image, label[, key])``.

    ``verify_sha256 = True``: a slice that covers a whole local tar shard is hashed as it is read and checked
    against the manifest after its last sample. Off by default: it costs about 1% of a decoding pipeline but 22% of
    raw reading (``scripts/bench/loader.py --sha256-only``); ``shards verify`` checks every shard's sha256.

    ``image_cache`` (``open_dataset(cache="memory")``, ``shards.cache.images``): decoded samples kept in memory
    shared by the workers, so epochs after the first skip decoding; ``close()`` lets go of it early.
    """

    verify_sha256 = False

    def __init__(self, split: SplitInfo, locations: Sequence[str], config: StreamConfig, *, storage: str,
                 decoder: Callable[[RawSample, int], Any] | None = None,
                 num_classes: int | None = None, storage_options: Any = None, url_origins: Sequence[str] = (),
                 shard_cache: CachedShards | None = None, image_cache: Any = None):
        super().__init__(split, locations, config, num_classes, shard_cache)
        self.storage = get_storage(storage)
        self.decoder = decoder if decoder is not None else ImageDecoder()  # called as decoder(sample, seed)
        self.image_cache = image_cache
        self.storage_options = storage_options  # for s3:// (an S3Options, picklable: each worker makes its client)
        self.url_origins = tuple(url_origins)  # where http(s) redirects may lead (locations.request_origins)
        for location in self.locations:
            if is_s3(location):
                continue  # every format reads by byte range from object storage (shards.formats.s3shards)
            if is_remote(location):
                if self.storage.read_stream is None:
                    raise InputError(f"{self.storage.name} shards must be local files; stream tar shards instead",
                                     path=location)
            elif not Path(location).is_file():
                raise MissingInputError("shard listed in the manifest is missing", path=location)

    def decode(self, sample: RawSample, seed: int) -> Any:
        return self.decoder(sample, seed)

    def decode_row(self, sample: RawSample, seed: int, row: int) -> Any:
        if self.image_cache is None:
            return self.decoder(sample, seed)
        return self.image_cache(sample, seed, row)

    def decode_marker(self) -> Any:
        if self.image_cache is not None:
            return self.image_cache
        return self.decoder  # ImageDecoder and FastDecoder set decoded_at; a user's decoder may too

    def close(self) -> None:
        """Release the image cache's memory in this process now (workers let go when they exit)."""
        if self.image_cache is not None:
            self.image_cache.close()

    def merge_gap(self, shard: int) -> int | None:
        """A tar shard without its byte index is walked from its first header on every read: one read for all its
        wanted rows, however far apart. Otherwise a read may pass over ``MERGE_GAP`` rows, about what one more
        seek, file open or ranged GET costs in reading time."""
        if self.storage.indexed and self.split_info.shards[shard].index is None:
            return None
        return MERGE_GAP

    def read_slice(self, piece: ShardSlice) -> Iterator[RawSample]:
        return self._read(piece, resync=False)

    def read_resync(self, piece: ShardSlice) -> Iterator[RawSample | CorruptDataError]:
        return self._read(piece, resync=True)

    def _read(self, piece: ShardSlice, resync: bool) -> Iterator[Any]:
        info = self.split_info.shards[piece.shard]
        mapping = self.label_maps[piece.shard] if self.label_maps is not None else None
        return checked_labels(self._read_source_slice(piece, resync), self.locations[piece.shard],
                              self.num_classes if mapping is None else len(mapping),
                              shard_counts=info.class_counts, mapping=mapping, resync=resync)

    def _read_source_slice(self, piece: ShardSlice, resync: bool) -> Iterator[Any]:
        location = self.locations[piece.shard]
        lease = self._cached_copy(piece.shard)
        if lease is not None:
            return self._read_cached(lease, location, piece, resync)
        if is_s3(location):
            return self._read_s3(location, piece, resync)
        if is_remote(location):
            return self._read_remote(location, piece, resync)
        info = self.split_info.shards[piece.shard]
        whole = self.verify_sha256 and piece.start == 0 and piece.stop >= info.samples
        sha256 = info.sha256 if whole else None
        return self.storage.read_slice(location, piece.start, piece.stop, sha256=sha256, resync=resync,
                                       **self._index_of(piece.shard))

    def _index_of(self, shard: int) -> dict[str, Any]:
        """``offsets=`` for a reader of an indexed format whose shard has its byte index: where a slice starts,
        and where reading resumes after a damaged sample."""
        if not self.storage.indexed or self.split_info.shards[shard].index is None:
            return {}
        return {"offsets": self._offsets(shard)}

    def _read_cached(self, lease: Any, location: str, piece: ShardSlice, resync: bool) -> Iterator[Any]:
        """A slice of the node-local copy (checked against the manifest's sha256 when it was fetched), held
        against eviction until the slice is read."""
        try:
            # The index only to seek (none over http(s)): the copy matched the manifest's sha256 when fetched, so
            # damage in it was packed in, rare enough to resync by scanning rather than fetch indexes from S3 for.
            seeks = piece.start > 0 and (is_s3(location) or not is_remote(location))
            extra = self._index_of(piece.shard) if seeks else {}
            yield from self.storage.read_slice(str(lease.path), piece.start, piece.stop, resync=resync, **extra)
        finally:
            lease.release()

    def _offsets(self, shard: int) -> Any:
        """The shard's checked per-sample byte index (beside it, on disk or on ``s3://``), loaded once per worker
        (each holds its own copy); None when the manifest records none, or when the index is damaged: it only
        speeds reads up, so its shard is then read by scanning its headers (``shards verify`` reports it)."""
        cache = self.__dict__.setdefault("_offsets_cache", {})
        if shard not in cache:
            location, info = self.locations[shard], self.split_info.shards[shard]
            try:
                if is_s3(location):
                    from shards.formats.s3shards import load_s3_index

                    cache[shard] = load_s3_index(location, info, self._s3_options())
                else:
                    cache[shard] = load_local_index(location, info)
            except CorruptDataError as exc:
                log.warning("%s; reading the shard by scanning its headers", exc)
                cache[shard] = None
        return cache[shard]

    def _s3_options(self) -> Any:
        """The ``S3Options`` in effect, made once per process copy."""
        if "_s3_options_value" not in self.__dict__:
            from shards.formats.s3 import S3Options

            self.__dict__["_s3_options_value"] = S3Options.from_mapping(self.storage_options)
        return self.__dict__["_s3_options_value"]

    def _read_s3(self, location: str, piece: ShardSlice, resync: bool) -> Iterator[Any]:
        """A slice from object storage: tar by its byte index (fetched once per worker) in one ranged GET, HDF5
        through a block-cached file object; see ``shards.formats.s3shards``."""
        info = self.split_info.shards[piece.shard]
        offsets = self._offsets(piece.shard) if self.storage.indexed else None
        return self.storage.read_s3_slice(location, piece.start, piece.stop, self._s3_options(), size=info.bytes,
                                          offsets=offsets, resync=resync)

    def _read_remote(self, location: str, piece: ShardSlice, resync: bool) -> Iterator[Any]:
        with open_remote(location, origins=self.url_origins) as stream:
            samples = self.storage.read_stream(stream, location, resync=resync)
            yield from itertools.islice(samples, piece.start, piece.stop)
