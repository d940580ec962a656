"""Reading ``http(s)://`` locations: one stream per request, every redirect held to the allowed origins; where the
server answers range requests, a whole object (``open_whole``) and a byte range (``open_parts``, ``read_ahead``,
for a tar slice by its index) in parallel ranged parts (``fetch_range``, ``shards.transport.parallel_parts``).

HTTP goes through ``urllib`` (no ``curl`` needed), following a redirect only to an allowed origin (the requested
URL's own, plus any the caller names), at most ``MAX_REDIRECTS`` hops: a server on an allowed origin cannot hand
the reader to another host (``shards.door.locations.check_redirect``). The location kinds that use it are in
``shards.transport.location`` (docs/design.md, section 4).

Every request is held to the caller's ``TransferLimits`` (``shards.transport.parallel_parts``; ``S3Options`` carries
them, docs/object-storage.md, "Slow servers"): the status line and headers must arrive within ``header_s`` (a
watchdog shuts the socket down, since ``urllib``'s timeout bounds only each wait for a byte), and every read of a
body is one ``read1`` timed by the request's ``TransferClock``, so a server that dribbles is cut off with a
``CorruptDataError`` naming the URL instead of holding the reader for hours.
"""

from __future__ import annotations

import http.client
import io
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from contextlib import closing, contextmanager, suppress
from typing import Any, BinaryIO, Iterable, Iterator

from shards.errors import CorruptDataError, ManifestError, MissingInputError, ShardcacheError
from shards.door.locations import check_redirect, url_origin
from shards.transport import parallel_parts
from shards.transport.parallel_parts import (
    DEFAULT_CONCURRENCY, DEFAULT_READ_AHEAD_BYTES, PartStream, TransferClock, TransferLimits, pool_for)

TIMEOUT_S = 60.0
MAX_REDIRECTS = 5
READ1_BYTES = 1 << 20  # at most this per read of a body: ``read1`` allocates what it is asked for before its recv
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*\Z")


class _OriginRedirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirect handling, with every hop checked against the allowed origins before it is requested (so a
    foreign server never sees a request) and at most ``MAX_REDIRECTS`` hops. The target is checked as the server
    sent it (before urllib's own scheme check, so ``file:`` gets the same error) and as urllib will request it."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, location: str, origins: Iterable[str]):
        super().__init__()
        self.location, self.origins = location, tuple(origins)

    def _check(self, fp: Any, target: str) -> None:
        try:
            check_redirect(self.location, target, self.origins)
        except ManifestError:
            fp.close()
            raise

    def http_error_302(self, req, fp, code, msg, headers):  # noqa: ANN001 - urllib's signature
        target = headers.get("location") or headers.get("uri")
        if target:
            self._check(fp, urllib.parse.urljoin(req.full_url, target))
        fp.close()  # urllib would read the redirect's body to its end first, at whatever pace the server sends it
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        self._check(fp, newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _HeaderWatch:
    """The watchdog of one request's status lines and headers (every hop's): a connection whose answer takes
    longer than ``seconds`` to arrive has its socket shut down, which ends the read blocked on it."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.fired = False

    def connection(self, http_class: type) -> Any:
        """``http_class`` (urllib's connection factory) with ``getresponse`` under this watch."""
        def make(host: str, **kwargs: Any) -> Any:
            connection = http_class(host, **kwargs)
            read_answer = connection.getresponse

            def getresponse() -> Any:
                timer = threading.Timer(self.seconds, self._cut, (connection,))
                timer.daemon = True
                timer.start()
                try:
                    return read_answer()
                finally:
                    timer.cancel()

            connection.getresponse = getresponse
            return connection

        return make

    def _cut(self, connection: Any) -> None:
        self.fired = True
        with suppress(OSError, AttributeError):
            connection.sock.shutdown(socket.SHUT_RDWR)


class _WatchedHandler:
    """Mixed into urllib's HTTP and HTTPS handlers: every connection they open is under ``watch``."""

    def __init__(self, watch: _HeaderWatch, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.watch = watch

    def do_open(self, http_class, req, **kwargs):  # noqa: ANN001 - urllib's signature
        return super().do_open(self.watch.connection(http_class), req, **kwargs)


class _HTTPHandler(_WatchedHandler, urllib.request.HTTPHandler):
    pass


class _HTTPSHandler(_WatchedHandler, urllib.request.HTTPSHandler):
    pass


class _Body(io.RawIOBase):
    """A response's body for the reader: each read one ``read1`` timed by the request's ``TransferClock``, every
    failure a ``CorruptDataError`` naming the URL (a body cut short of its ``Content-Length`` too). Read through an
    ``io.BufferedReader``, which fills each ``read(n)``."""

    def __init__(self, response: Any, url: str, limits: TransferLimits):
        super().__init__()
        self.response, self.url = response, url
        self.clock = TransferClock(limits, url)
        self.received = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data = self.clock.read(self.response.read1, min(view.nbytes, READ1_BYTES))
        except ShardcacheError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise CorruptDataError(f"body broke at byte {self.received} ({type(exc).__name__}: {exc})",
                                   path=self.url) from exc
        if not data and view.nbytes and self.response.length:  # the server closed before its Content-Length
            raise CorruptDataError(f"body ended at byte {self.received}, {self.response.length} bytes short of its "
                                   "Content-Length", path=self.url)
        view[:len(data)] = data
        self.received += len(data)
        return len(data)

    def close(self) -> None:
        self.response.close()
        super().close()


def _body(response: Any, url: str, limits: TransferLimits) -> io.BufferedReader:
    return io.BufferedReader(_Body(response, url, limits), 1 << 20)


def _request(location: str, origins: Iterable[str], headers: dict[str, str] | None = None,
             method: str = "GET", limits: TransferLimits = TransferLimits()) -> Any:
    """The response to a GET (or ``method``) of ``location`` (errors name it); redirects held to the allowed
    origins, the status line and headers to ``limits.header_s``. Its body is the caller's to read (``_body``)."""
    allowed = (*filter(None, [url_origin(location)]), *origins)
    request = urllib.request.Request(location, headers=headers or {}, method=method)
    watch = _HeaderWatch(limits.header_s)
    opener = urllib.request.build_opener(_OriginRedirects(location, allowed), _HTTPHandler(watch),
                                         _HTTPSHandler(watch))
    cut_off = CorruptDataError(f"cut off: no complete status line and headers within {limits.header_s:g} s "
                               "(rate_window_s, request_deadline_s)", path=location)
    try:
        response = opener.open(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise MissingInputError("not found (HTTP 404)", path=location) from exc
        if 300 <= exc.code < 400:  # urllib's message for a redirect loop spans lines: keep its first
            first = (str(exc.reason).splitlines() or [""])[0]
            raise CorruptDataError(f"HTTP {exc.code}: redirect not followed ({first}; at most {MAX_REDIRECTS} "
                                   "hops are followed)", path=location) from exc
        raise CorruptDataError(f"HTTP {exc.code} {exc.reason}", path=location) from exc
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        if watch.fired:
            raise cut_off from None
        raise CorruptDataError(f"cannot open ({type(exc).__name__}: {exc})", path=location) from exc
    if watch.fired:  # the headers read up to the cut look complete: the answer is not the server's
        response.close()
        raise cut_off
    return response


@contextmanager
def open_url(location: str, *, origins: Iterable[str] = (),
             limits: TransferLimits = TransferLimits()) -> Iterator[BinaryIO]:
    """An ``http(s)`` location opened for sequential reading; errors name the location. ``origins``: where redirects
    may lead besides the location's own origin (a dataset's ``shards.door.locations.request_origins``: its
    manifest's own and the caller's ``Remote(url_origins=...)``); any other target is a ``ManifestError``.
    ``limits``: how slow the server may be (see the module docstring)."""
    stream = _body(_request(location, origins, limits=limits), location, limits)
    try:
        yield stream
    finally:
        stream.close()


def _content_range(response: Any) -> tuple[int, int | None] | None:
    """``(first byte, total size or None)`` of a 206 answer's ``Content-Range``; None for any other answer."""
    if getattr(response, "status", None) != 206:
        return None
    match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
    if match is None:
        return None
    return int(match.group(1)), None if match.group(3) == "*" else int(match.group(3))


def fetch_range(location: str, start: int, stop: int, origins: Iterable[str] = (),
                limits: TransferLimits = TransferLimits()) -> bytes:
    """Exactly bytes ``[start, stop)`` of ``location`` by one ranged GET (a server that answers otherwise, or
    with fewer bytes, is a ``CorruptDataError`` naming it)."""
    with closing(_request(location, origins, {"Range": f"bytes={start}-{stop - 1}"}, limits=limits)) as response:
        answered = _content_range(response)
        if answered is None or answered[0] != start:
            raise CorruptDataError(f"the server did not answer the range request for bytes {start}-{stop - 1} "
                                   f"(HTTP {getattr(response, 'status', '?')})", path=location)
        data = _body(response, location, limits).read(stop - start)
    if len(data) != stop - start:
        raise CorruptDataError(f"short read at byte {start} ({len(data)} of {stop - start} bytes)", path=location)
    return data


@contextmanager
def open_whole(location: str, *, origins: Iterable[str] = (),
               limits: TransferLimits = TransferLimits()) -> Iterator[BinaryIO]:
    """The whole object at ``location``: where the server answers a range request (206 with its size), the first
    ``FIRST_PART`` bytes and then the rest in parallel parts (``shards.transport.parallel_parts``); otherwise the one
    stream of its 200 answer, as ``open_url``."""
    first_part = parallel_parts.FIRST_PART
    response = _request(location, origins, {"Range": f"bytes=0-{first_part - 1}"}, limits=limits)
    answered = _content_range(response)
    body = _body(response, location, limits)
    if answered is None or answered[0] != 0 or answered[1] is None:
        try:
            yield body  # no ranges here (or a size not given): the whole body, in one stream
        finally:
            body.close()
        return
    with closing(body):
        head = body.read(first_part)
    size = answered[1]
    if size <= len(head):
        stream: Any = io.BytesIO(head)
    else:
        stream = io.BufferedReader(PartStream(_fetcher(location, origins, limits), location, len(head), size,
                                              pool_for(DEFAULT_CONCURRENCY), head=head), 1 << 20)
    try:
        yield stream
    finally:
        stream.close()


_answers_ranges: dict[str, bool] = {}  # location -> its server says it answers range requests (asked once)


def accepts_ranges(location: str, origins: Iterable[str] = (), limits: TransferLimits = TransferLimits()) -> bool:
    """Whether the server of ``location`` answers range requests (a HEAD says ``Accept-Ranges: bytes``), asked once
    per process and location; a server that refuses HEAD is read as one stream."""
    if location not in _answers_ranges:
        try:
            with closing(_request(location, origins, method="HEAD", limits=limits)) as response:
                answer = response.headers.get("Accept-Ranges", "").strip().lower() == "bytes"
        except CorruptDataError:
            answer = False
        _answers_ranges[location] = answer
    return _answers_ranges[location]


def object_state(location: str, origins: Iterable[str] = (),
                 limits: TransferLimits = TransferLimits()) -> tuple[int | None, str, str]:
    """``(size or None, ETag, Last-Modified)`` of ``location`` as a HEAD answers them (empty strings where the
    server gives none): what tells a rerun that an object changed without reading it."""
    with closing(_request(location, origins, method="HEAD", limits=limits)) as response:
        headers = response.headers
        length = headers.get("Content-Length", "")
        size = int(length) if length.strip().isdigit() else None
        return size, headers.get("ETag", "")[:256], headers.get("Last-Modified", "")[:256]


def _fetcher(location: str, origins: Iterable[str], limits: TransferLimits):
    origins = tuple(origins)
    return lambda start, stop: fetch_range(location, start, stop, origins, limits)


def open_parts(location: str, start: int, stop: int, origins: Iterable[str] = (),
               limits: TransferLimits = TransferLimits()) -> PartStream:
    """Bytes ``[start, stop)`` of ``location`` in parallel ranged parts (the stream ``read_ahead`` opened for them,
    when there is one); only for a location whose server ``accepts_ranges``."""
    return parallel_parts.open_range(_fetcher(location, origins, limits), location, start, stop,
                                     DEFAULT_CONCURRENCY)


def read_ahead(location: str, start: int, stop: int, origins: Iterable[str] = (),
               limits: TransferLimits = TransferLimits()) -> bool:
    """Start ``[start, stop)`` of ``location`` now for a later ``open_parts``; False when the default read-ahead
    budget (``DEFAULT_READ_AHEAD_BYTES``) has no room."""
    return parallel_parts.read_ahead(_fetcher(location, origins, limits), location, start, stop,
                                     DEFAULT_CONCURRENCY, DEFAULT_READ_AHEAD_BYTES)


def ranged_tar_slice(url: str, start: int, stop: int, offsets: Any, origins: Iterable[str], limits: Any, *,
                     resync: bool = False) -> Iterator[Any]:
    """Samples ``start:stop`` of the tar at ``url`` by its byte index ``offsets``, in ranged parts (a server that
    answers ranges)."""
    from shards.transport.s3shards import iter_tar_range, tar_slice_range

    first, last = tar_slice_range(offsets, start, stop)
    if first < last:
        with open_parts(url, first, last, origins, limits) as stream:
            yield from iter_tar_range(stream, url, start, stop, offsets, resync=resync)


def adopted_rows(url: str, start: int, stop: int, rows: Any, origins: Iterable[str], limits: Any, *,
                 resync: bool = False) -> Iterator[Any]:
    """Rows ``start:stop`` of an adopted tar (``shards.formats.adopted``): the bytes they span in ranged parts where
    the server answers ranges, else the stream from byte 0 with the bytes before each row passed over."""
    from shards.formats.adopted import iter_adopted_stream, row_span

    if rows is None:
        raise CorruptDataError("an adopted tar is read by its row index, and none was loaded", path=url)
    first, last = row_span(rows, start, stop)
    if first >= last:
        return
    ranged = accepts_ranges(url, origins, limits)
    with (open_parts(url, first, last, origins, limits) if ranged else open_url(url, origins=origins, limits=limits)) \
            as stream:
        yield from iter_adopted_stream(io.BufferedReader(stream, 1 << 20), url, rows, start, stop, resync=resync,
                                       from_start=not ranged)
