"""Locations: where a shard's (or a manifest's) bytes are, and how to read them (docs/design.md, section 4).

Code above ``shards.formats`` never asks whether a path is local, ``http(s)://``, ``s3://`` or ``pipe:``: it asks a
location. ``locate`` is the one place that looks at the scheme; it returns one of four kinds:

- ``LocalFile``: a file or folder on this machine (the node cache's copy of any shard is one: its lease's path);
- ``S3Object``: ``s3://bucket/key``, read by ranged GETs, retried and resumed (``shards.transport.s3_ranges``), a
  slice of a tar by its byte index (``shards.transport.s3shards``), long reads in parallel parts and the coming
  slices read ahead (``shards.transport.s3_parallel``);
- ``HttpUrl``: ``http(s)://``, a slice read as one stream, a whole object in parallel parts where the server
  answers ranges, every redirect held to the allowed origins (``shards.transport.remote``);
- ``PipeCommand``: ``pipe:CMD``, a command the caller gave whose stdout is the shard (never from a manifest).

Each knows how to read a slice of an image shard (``read_slice``, with resync, the byte index and the sha256
check where the kind allows them), fetch a whole object checked against its size and sha256 (``fetch_checked``,
with the other whole-object reads in ``shards.transport.whole_reads``), list the files a folder, prefix or brace
pattern names (``list``, one rule for every kind: ``shards.transport.listing``), join a name under it (``child``: a
name a manifest gives, confined; ``file``: one of our own fixed names), and says what it can do, for callers to ask
instead of its kind: ``local_path()`` (the path on this machine, for mmap, resolving and comparing folders; None
elsewhere), ``can_list``, ``addressable``, ``publishable``, ``reads_ahead``.

How remote kinds are reached comes only from the caller, never from a manifest: ``storage_options`` (an
``S3Options`` or a mapping of its fields) for ``s3://``, and for ``http(s)`` how slow a server may be
(``S3Options.transfer_limits``), ``origins`` (``shards.door.locations.request_origins``) for the redirects of
``http(s)``. A location carries them to every location joined under it, and pickles with them into DataLoader
workers.
"""

from __future__ import annotations

import itertools
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, ContextManager, Iterable, Iterator

from shards.door.bounded_read import not_regular_reason, open_regular_file, read_regular_file
from shards.errors import CorruptDataError, InputError, ManifestError, MissingInputError
from shards.errors import redact
from shards.door.locations import shard_location
from shards.transport import listing
from shards.transport.whole_reads import WholeReads


class Location(WholeReads):
    """Where bytes are (``text``), with the caller's means of reaching them. Subclasses say how each is read."""

    can_list = False  # ``list`` can walk a folder or prefix of this kind (else only spelled names are listed)
    lister: Any = None  # how ``list`` lists this kind (``shards.transport.listing``); None: it cannot
    addressable = True  # the same bytes can be fetched again by name, so a node-local copy can stand for them
    uses_storage_options = False  # reached with the caller's S3 options
    publishable = False  # a writer may publish a finished output here (staged locally, then uploaded)
    reads_ahead = False  # ``read_ahead`` can start a later ``read_slice``'s bytes early

    def __init__(self, text: str, *, storage_options: Any = None, origins: Iterable[str] = ()):
        self.text = text
        self.storage_options = storage_options
        self.origins = tuple(origins)

    def __str__(self) -> str:
        return redact(self.text)  # how a location is shown: never its URL's credentials

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.text)!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.text == self.text  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.text))

    # -- names ----------------------------------------------------------------------------------------------------
    def at(self, text: str) -> Location:
        """The location ``text`` names, reached as this one is (its storage options and origins)."""
        return locate(text, storage_options=self.storage_options, origins=self.origins)

    @property
    def path(self) -> Path:
        """The local path; only a ``LocalFile`` has one."""
        raise InputError("is not a path on this machine", path=self.text)

    def local_path(self) -> Path | None:
        """The path on this machine where these bytes lie (to map, to resolve, to compare folders), else None: they
        come over a connection or from a command."""
        return None

    def child(self, name: str, *, where: str | None = None, what: str = "shard") -> Location:
        """Where a file a manifest names (a shard, a sidecar, the source index: ``what``) is under this folder or
        prefix: checked and confined (``shards.door.locations.shard_location``); ``where`` names the manifest."""
        return self.at(shard_location(self.text, name, where=where, what=what))

    def file(self, name: str) -> Location:
        """This folder's own file ``name`` (``dataset.json``, ``features.json``): a fixed name of ours, not one a
        manifest chose, so it needs no confinement."""
        return self.at(self.text.rstrip("/") + "/" + name)

    @property
    def parent(self) -> Location:
        return self.at(self.text.rstrip("/").rsplit("/", 1)[0])

    def record(self) -> str:
        """How a configuration records this location (a local path made absolute, a URL as it is but for its
        credentials, which a record never holds)."""
        return redact(self.text)

    def list(self, pattern: str = "*") -> listing.Listing:
        """The files this folder, prefix or brace pattern names, as a ``shards.transport.listing.Listing`` (one rule
        for every kind, that module's): a folder's files whose relative names match the glob ``pattern``, or the
        files spelled out, each with its size and version; the names refused unread, with the reason."""
        if self.lister is None:
            raise InputError(listing.NOT_LISTABLE, path=self.text)
        return self.lister(self, pattern)

    # -- checks before reading ------------------------------------------------------------------------------------
    def check_image_shard(self, storage: Any) -> None:
        """Refuse, before an epoch starts, an image shard that cannot be read from here (missing, or a format that
        needs seeking where the bytes come as a stream)."""

    def check_feature_shard(self) -> None:
        """Refuse, before an epoch starts, a feature shard that cannot be read from here."""

    # -- reading --------------------------------------------------------------------------------------------------
    def open(self) -> ContextManager[BinaryIO]:
        """The whole object as one sequential stream (a context manager)."""
        raise NotImplementedError

    def read_slice(self, storage: Any, start: int, stop: int, *, size: int, offsets: Any = None,
                   sha256: str | None = None, resync: bool = False) -> Iterator[Any]:
        """Samples ``start:stop`` of an image shard in ``storage``'s format (``shards.transport.storage``), ``size``
        bytes long, ``offsets`` its checked byte index (or None). ``sha256``: checked after the last sample where
        the read passes over every byte of the shard (local files); ``resync``: a damaged sample is yielded as its
        ``CorruptDataError`` and reading goes on."""
        raise NotImplementedError

    def load_index(self, info: Any) -> Any:
        """The checked per-sample byte index of the tar shard here (``info``: its ``ShardInfo``), or None (none
        recorded, a sidecar gone, or a stream that could not use one)."""
        return None

    def read_ahead(self, storage: Any, start: int, stop: int, *, offsets: Any = None) -> bool:
        """Start fetching now the bytes a later ``read_slice`` of the same samples will read, where this kind reads
        by byte range (``shards.transport.parallel_parts``: the reader takes them instead of fetching again). False
        when the read-ahead budget has no room for them (ask again later); True when started, or nothing to do."""
        return True

    def read_ahead_object(self, size: int) -> bool:
        """Start fetching now the whole object (``size`` bytes, as the manifest says) that a later ``fetch_checked``
        will read, where this kind reads by byte range; False when the read-ahead budget has no room (ask again
        later); True when started, or nothing to do."""
        return True

    def open_sized(self, size: int) -> ContextManager[BinaryIO]:
        """The whole object, which the manifest says is ``size`` bytes (the checks are the caller's; a kind that
        reads by range may fetch every part at once, and stop at ``size``)."""
        return self.open()


class LocalFile(Location):
    """A file or folder on this machine."""

    can_list = True
    lister = staticmethod(listing.list_local)

    @property
    def path(self) -> Path:
        return Path(self.text)

    def local_path(self) -> Path | None:
        return Path(self.text)

    def file(self, name: str) -> Location:
        return self.at(str(Path(self.text) / name))

    @property
    def parent(self) -> Location:
        return self.at(str(Path(self.text).parent))

    def record(self) -> str:
        return os.path.abspath(self.text)

    def check_image_shard(self, storage: Any) -> None:
        self._check_present("shard")

    def check_feature_shard(self) -> None:
        self._check_present("feature shard")

    def _check_present(self, what: str) -> None:
        """Missing, or there but not a regular file (a FIFO, a folder): two different lines."""
        try:
            mode = os.stat(self.text).st_mode
        except FileNotFoundError:
            raise MissingInputError(f"{what} listed in the manifest is missing", path=self.text) from None
        except OSError as exc:
            raise CorruptDataError(f"{what} listed in the manifest cannot be read ({exc.strerror or exc})",
                                   path=self.text) from None
        reason = not_regular_reason(mode)
        if reason is not None:
            raise CorruptDataError(f"{what} listed in the manifest is {reason}", path=self.text)

    @contextmanager
    def open(self) -> Iterator[BinaryIO]:
        """A regular file only: a FIFO or device in a shard's place is refused unopened, never waited on."""
        with open_regular_file(self.text, error=CorruptDataError) as stream:
            yield stream

    def read_slice(self, storage: Any, start: int, stop: int, *, size: int, offsets: Any = None,
                   sha256: str | None = None, resync: bool = False) -> Iterator[Any]:
        """One seek to ``start`` (by the byte index, or by walking the headers before it)."""
        extra = {"offsets": offsets} if storage.indexed and offsets is not None else {}
        return storage.read_slice(self.text, start, stop, sha256=sha256, resync=resync, **extra)

    def load_index(self, info: Any) -> Any:
        from shards.formats.tarindex import load_local_index

        return load_local_index(self.text, info)

    @contextmanager
    def local_copy(self, limit: int | None = None) -> Iterator[Path]:
        yield self.path

    def read_capped(self) -> bytes:
        """Only a regular file is opened (a FIFO or device is refused unopened), within the size limit."""
        return read_regular_file(self.text, error=ManifestError)


class S3Object(Location):
    """``s3://bucket/key`` (``shards.transport.s3``): every format reads by byte range."""

    uses_storage_options = True
    publishable = True
    reads_ahead = True
    can_list = True
    lister = staticmethod(listing.list_s3)  # one retried listing of the prefix (``listing.list_objects``)

    def options(self) -> Any:
        from shards.transport.s3 import S3Options

        return S3Options.from_mapping(self.storage_options)

    @contextmanager
    def open(self) -> Iterator[BinaryIO]:
        """The whole object, in parallel ranged parts after its first GET (``shards.transport.s3_parallel``)."""
        from shards.transport.s3_parallel import open_whole

        stream = open_whole(self.text, self.options())
        try:
            yield stream
        finally:
            stream.close()

    @contextmanager
    def open_sized(self, size: int) -> Iterator[BinaryIO]:
        """Every part of the ``size`` bytes requested at once; a response giving another size is a
        ``ChecksumError``."""
        from shards.transport.s3_parallel import open_sized

        stream = open_sized(self.text, size, self.options())
        try:
            yield stream
        finally:
            stream.close()

    def read_slice(self, storage: Any, start: int, stop: int, *, size: int, offsets: Any = None,
                   sha256: str | None = None, resync: bool = False) -> Iterator[Any]:
        """Tar by its byte index in one ranged GET, HDF5 through a block-cached file object
        (``shards.transport.s3shards``)."""
        return storage.read_s3_slice(self.text, start, stop, self.options(), size=size, offsets=offsets,
                                     resync=resync)

    def load_index(self, info: Any) -> Any:
        from shards.transport.s3shards import load_s3_index

        return load_s3_index(self.text, info, self.options())

    def read_ahead(self, storage: Any, start: int, stop: int, *, offsets: Any = None) -> bool:
        """A tar slice by its byte index: those bytes in flight now, within ``S3Options.read_ahead_bytes``."""
        from shards.transport.s3_parallel import read_ahead
        from shards.transport.s3shards import indexed_span

        span = indexed_span(storage, start, stop, offsets)
        return span is None or read_ahead(self.text, *span, self.options())

    def read_ahead_object(self, size: int) -> bool:
        """The whole object in flight now, within ``S3Options.read_ahead_bytes``, for a later ``fetch_checked``."""
        from shards.transport.s3_parallel import read_ahead_sized

        return read_ahead_sized(self.text, size, self.options())


class _Stream(Location):
    """A location read only as one stream from its first byte."""

    def read_slice(self, storage: Any, start: int, stop: int, *, size: int, offsets: Any = None,
                   sha256: str | None = None, resync: bool = False) -> Iterator[Any]:
        """The stream from byte 0, the samples before ``start`` read and dropped: a stream cannot seek."""
        with self.open_stream() as stream:
            yield from itertools.islice(storage.read_stream(stream, self.text, resync=resync), start, stop)

    def open_stream(self) -> ContextManager[BinaryIO]:
        """The object as one sequential stream from its first byte, fetched only as far as it is read."""
        return self.open()

    def check_image_shard(self, storage: Any) -> None:
        if storage.read_stream is None:
            raise InputError(f"{storage.name} shards must be local files; stream tar shards instead", path=self.text)

    def check_feature_shard(self) -> None:
        raise InputError("feature shards must be local files or on s3://", path=self.text)


class HttpUrl(_Stream):
    """``http(s)://``: redirects only to the URL's own origin and the caller's ``origins``. Where the server answers
    range requests, a tar slice is read by its byte index in parallel parts, like ``s3://``; else as a stream.
    Every request is held to the storage options' ``transfer_limits`` (a server that dribbles is cut off)."""

    reads_ahead = True
    lister = staticmethod(listing.list_http)  # spelled names only (HTTP has no listing), each asked for its state

    def limits(self) -> Any:
        from shards.transport.s3 import S3Options

        return S3Options.from_mapping(self.storage_options).transfer_limits()

    def load_index(self, info: Any) -> Any:
        """The byte index, only where the server answers ranges (a stream from byte 0 has no use for it)."""
        from shards.transport.remote import accepts_ranges, open_url
        from shards.transport.s3shards import load_index_by

        limits = self.limits()
        if getattr(info, "index", None) is None or not accepts_ranges(self.text, self.origins, limits):
            return None
        return load_index_by(lambda where: open_url(where, origins=self.origins, limits=limits), self.text, info)

    def read_slice(self, storage: Any, start: int, stop: int, *, size: int, offsets: Any = None,
                   sha256: str | None = None, resync: bool = False) -> Iterator[Any]:
        """A tar slice by its byte index (given only where the server answers ranges), else the stream."""
        from shards.transport.remote import adopted_rows, ranged_tar_slice

        if storage.load_index is not None:
            return adopted_rows(self.text, start, stop, offsets, self.origins, self.limits(), resync=resync)
        if not storage.indexed or offsets is None:
            return super().read_slice(storage, start, stop, size=size, offsets=offsets, sha256=sha256,
                                      resync=resync)
        return ranged_tar_slice(self.text, start, stop, offsets, self.origins, self.limits(), resync=resync)

    def check_image_shard(self, storage: Any) -> None:
        if storage.load_index is None:  # adopted tars are read by their row index, ranged or not
            super().check_image_shard(storage)

    def read_ahead(self, storage: Any, start: int, stop: int, *, offsets: Any = None) -> bool:
        from shards.transport.remote import accepts_ranges, read_ahead
        from shards.transport.s3shards import indexed_span

        span = indexed_span(storage, start, stop, offsets)
        if span is not None and storage.load_index is not None \
                and not accepts_ranges(self.text, self.origins, self.limits()):
            return True  # an adopted tar's rows on a server without ranges: read as a stream, nothing to start
        return span is None or read_ahead(self.text, *span, self.origins, self.limits())

    def open(self) -> ContextManager[BinaryIO]:
        """The whole object: in parallel ranged parts where the server answers ranges, else one stream."""
        from shards.transport.remote import open_whole

        return open_whole(self.text, origins=self.origins, limits=self.limits())

    def open_stream(self) -> ContextManager[BinaryIO]:
        from shards.transport.remote import open_url

        return open_url(self.text, origins=self.origins, limits=self.limits())


class PipeCommand(_Stream):
    """``pipe:CMD`` (webdataset's opener runs it and reads its stdout): only ever the caller's own location."""

    addressable = False  # a command's output has no name to fetch it again by: never cached

    @contextmanager
    def open(self) -> Iterator[BinaryIO]:
        from webdataset.gopen import gopen_pipe

        stream = gopen_pipe(self.text, "rb", bufsize=1 << 20)
        try:
            yield stream
        finally:
            stream.close()


_KINDS = (("s3://", S3Object), ("http://", HttpUrl), ("https://", HttpUrl), ("pipe:", PipeCommand))


def locate(where: str | os.PathLike | Location, *, storage_options: Any = None,
           origins: Iterable[str] = ()) -> Location:
    """The location ``where`` names (a location passes through as it is): the one place that reads a scheme.
    Anything without one of the schemes above is a local path."""
    if isinstance(where, Location):
        return where
    text = os.fspath(where)
    kind = next((kind for scheme, kind in _KINDS if text.startswith(scheme)), LocalFile)
    return kind(text, storage_options=storage_options, origins=origins)
