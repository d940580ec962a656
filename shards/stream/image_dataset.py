"""The image-shard dataset: tar or HDF5 shards, local, behind the node cache, on ``s3://``, ``http(s)://`` or ``pipe:``,
read into ``RawSample`` and decoded by a pluggable ``decoder(sample, seed)``.

Everything about order, epochs, resume and errors lives in the base class (``shards.stream.dataset``); this module
holds only how image bytes are reached and turned into outputs, and the label check every sample passes before
anything uses its label (``checked_labels``, which also maps a mixture's class lists).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, Sequence

from shards.cache.cached_shards import CachedShards
from shards.errors import CorruptDataError
from shards.transport.location import LocalFile, Location, locate
from shards.transport.parallel_parts import drop_read_ahead
from shards.formats.sample import RawSample, label_problem
from shards.transport.storage import get_storage
from shards.image.decode import ImageDecoder
from shards.manifest import SplitInfo
from shards.stream.dataset import Selection, ShardDataset, StreamConfig
from shards.stream.worker_stream import StreamState
from shards.order.plan import ShardSlice
from shards.order.reads import CoveringReads

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


MERGE_GAP = 32  # unwanted rows a read may pass over (shards.order.reads.CoveringReads)
AHEAD_READS = 1024  # covering reads past the current one offered for read-ahead, at most


class ImageShardDataset(ShardDataset):
    """Image shards (tar or HDF5, wherever ``shards.transport.location`` reaches) -> ``(image, label[, key])``.

    ``verify_sha256 = True``: a slice that covers a whole local tar shard is hashed as it is read and checked
    against the manifest after its last sample. Off by default: it costs about 1% of a decoding pipeline but 22% of
    raw reading (``scripts/bench/loader.py --sha256-only``); ``shards verify`` checks every shard's sha256.

    ``image_cache`` (``open_dataset(cache="memory")``, ``shards.cache.images``): decoded samples kept in memory
    shared by the workers, so epochs after the first skip decoding; ``close()`` lets go of it early.
    """

    verify_sha256 = False
    ready_rows = False  # samples to decode and collate: the in-process run mode decodes them one by one

    def __init__(self, split: SplitInfo, locations: Sequence[str], config: StreamConfig, *, storage: str,
                 decoder: Callable[[RawSample, int], Any] | None = None,
                 num_classes: int | None = None, storage_options: Any = None, url_origins: Sequence[str] = (),
                 shard_cache: CachedShards | None = None, image_cache: Any = None,
                 shard_storages: Sequence[str] | None = None, index_roots: Sequence[str | None] | None = None,
                 selection: Selection = Selection()):
        super().__init__(split, locations, config, num_classes, shard_cache, selection)
        self.storage = get_storage(storage)
        # Per shard: its format (a mixture may hold packed and adopted tars) and, for a format that keeps its index
        # with the manifest (adopted tars), that manifest's folder.
        self.storages = tuple(get_storage(name) for name in shard_storages) if shard_storages is not None \
            else (self.storage,) * len(self.locations)
        self.index_roots = tuple(index_roots) if index_roots is not None else (None,) * len(self.locations)
        self.decoder = decoder if decoder is not None else ImageDecoder()  # called as decoder(sample, seed)
        self.image_cache = image_cache
        self.storage_options = storage_options  # for s3:// (an S3Options, picklable: each worker makes its client)
        self.url_origins = tuple(url_origins)  # where http(s) redirects may lead (locations.request_origins)
        for location, format_ in zip(self.locations, self.storages):
            self._where(location).check_image_shard(format_)

    def decode(self, sample: RawSample, seed: int) -> Any:
        return self.decoder(sample, seed)

    def decode_row(self, sample: RawSample, seed: int, row: int) -> Any:
        if self.image_cache is None:
            return self.decoder(sample, seed)
        return self.image_cache(sample, seed, row)

    def decode_marker(self) -> Any:
        return self.decoder  # ImageDecoder, FastDecoder and the image cache mark in their thread; a user's may here

    def normalizer(self, **options: Any) -> Callable:
        """The decoder's own per-batch step when it leaves one (the fast pipeline's uint8 batches -> the spec's
        normalised floats, ``shards.image.fast.Normalize``), else the identity (a standard transform normalised
        in the workers)."""
        own = getattr(self.decoder, "normalizer", None)
        return super().normalizer(**options) if own is None else own(**options)

    def close(self) -> None:
        """Release the image cache's memory in this process now (workers let go when they exit)."""
        if self.image_cache is not None:
            self.image_cache.close()

    def indexed_shards(self) -> list[bool]:
        """Per shard, whether its format reads a slice by byte range through a byte index (tar) rather than about
        the slice's own bytes (HDF5): how the forecast counts a read's requests (``shards.forecast.plan``)."""
        return [bool(storage.indexed) for storage in self.storages]

    def merge_gap(self, shard: int) -> int | None:
        """A tar shard without its byte index is walked from its first header on every read: one read for all its
        wanted rows, however far apart. Otherwise a read may pass over ``MERGE_GAP`` rows, about what one more
        seek, file open or ranged GET costs in reading time."""
        if self.storages[shard].indexed and self.split_info.shards[shard].index is None:
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

    def _where(self, location: str) -> Location:
        """The location ``location`` names, reached with this dataset's storage options and origins (the
        caller's, never a manifest's)."""
        return locate(location, storage_options=self.storage_options, origins=self.url_origins)

    def _read_source_slice(self, piece: ShardSlice, resync: bool) -> Iterator[Any]:
        """A slice from wherever the shard is (``shards.transport.location``): a local file by one seek, ``s3://``
        by byte range (a tar by its byte index in one GET), ``http(s)``/``pipe:`` as a stream; the node-local copy
        when the cache holds one. ``verify_sha256``: a read of a whole local shard checks its sha256."""
        lease = self._cached_copy(piece.shard)
        if lease is not None:
            return self._read_cached(lease, piece, resync)
        info = self.split_info.shards[piece.shard]
        whole = self.verify_sha256 and piece.start == 0 and piece.stop >= info.samples
        return self._where(self.locations[piece.shard]).read_slice(
            self.storages[piece.shard], piece.start, piece.stop, size=info.bytes, offsets=self._index_of(piece.shard),
            sha256=info.sha256 if whole else None, resync=resync)

    def read_ahead(self, reads: CoveringReads, i: int, stream: StreamState) -> None:
        """Before covering read ``i`` is read: it and the reads after it in flight already, as far as the location's
        read-ahead budget allows (``Location.read_ahead``: tar slices by their byte index on ``s3://`` and ranged
        ``http(s)``), so the next reads arrive while this one is decoded. Only reads the plan makes, each once: a
        cursor per plan (a new ``reads`` drops what the last plan left unread), at most ``AHEAD_READS`` past ``i``.
        Shards read through the node cache are skipped: the cache fetches them whole."""
        if not self._any_read_ahead():
            return
        cursor = stream.ahead
        if cursor is None or cursor[0] is not reads:
            drop_read_ahead()
            cursor = stream.ahead = [reads, i]
        k = max(cursor[1], i)
        while k < min(len(reads), i + AHEAD_READS):
            piece, _ = reads[k]
            if not self._through_cache(piece.shard) and not self._where(self.locations[piece.shard]).read_ahead(
                    self.storages[piece.shard], piece.start, piece.stop, offsets=self._index_of(piece.shard)):
                break  # no room in the budget: offered again before a later read
            k += 1
        cursor[1] = k

    def _any_read_ahead(self) -> bool:
        """Whether any shard is read where reads can start early and not through the node cache (asked once)."""
        if "_reads_ahead_somewhere" not in self.__dict__:
            self._reads_ahead_somewhere = any(self._where(location).reads_ahead and not self._through_cache(shard)
                                              for shard, location in enumerate(self.locations))
        return self._reads_ahead_somewhere

    def _index_of(self, shard: int) -> Any:
        """The byte index of a shard in an indexed format that records one (where a slice starts, and where
        reading resumes after a damaged sample), else None."""
        if not self.storages[shard].indexed or self.split_info.shards[shard].index is None:
            return None
        return self._offsets(shard)

    def _read_cached(self, lease: Any, piece: ShardSlice, resync: bool) -> Iterator[Any]:
        """A slice of the node-local copy (checked against the manifest's sha256 when it was fetched), held
        against eviction until the slice is read."""
        try:
            # The index only to seek (a stream's location has none to give): the copy matched the manifest's
            # sha256 when fetched, so damage in it was packed in, rare enough to resync by scanning.
            storage = self.storages[piece.shard]
            needed = piece.start > 0 or storage.load_index is not None  # adopted tars: always by their rows
            offsets = self._index_of(piece.shard) if needed else None
            yield from LocalFile(str(lease.path)).read_slice(storage, piece.start, piece.stop,
                                                             size=self.split_info.shards[piece.shard].bytes,
                                                             offsets=offsets, resync=resync)
        finally:
            lease.release()

    def _offsets(self, shard: int) -> Any:
        """The shard's checked per-sample byte index (beside it, on disk or on ``s3://``), loaded once per worker
        (each holds its own copy); None when the manifest records none, or when the index is damaged: it only
        speeds reads up, so its shard is then read by scanning its headers (``shards verify`` reports it)."""
        cache = self.__dict__.setdefault("_offsets_cache", {})
        load_index = self.storages[shard].load_index
        if shard not in cache and load_index is not None:  # no index, no read: its errors are the read's
            cache[shard] = load_index(self._where(self.index_roots[shard]), self.split_info.shards[shard])
        if shard not in cache:
            try:
                cache[shard] = self._where(self.locations[shard]).load_index(self.split_info.shards[shard])
            except CorruptDataError as exc:
                log.warning("%s; reading the shard by scanning its headers", exc)
                cache[shard] = None
        return cache[shard]
