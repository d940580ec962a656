"""Reading ``http(s)://`` locations: one stream per request, every redirect held to the allowed origins; where the
server answers range requests, a whole object (``open_whole``) and a byte range (``open_parts``, ``read_ahead``,
for a tar slice by its index) in parallel ranged parts (``fetch_range``, ``shards.formats.parallel_parts``).

HTTP goes through ``urllib`` (no ``curl`` needed), following a redirect only to an allowed origin (the requested
URL's own, plus any the caller names), at most ``MAX_REDIRECTS`` hops: a server on an allowed origin cannot hand
the reader to another host (``shards.formats.locations.check_redirect``). The location kinds that use it are in
``shards.formats.location`` (docs/design.md, section 4).
"""

from __future__ import annotations

import http.client
import io
import re
import urllib.error
import urllib.parse
import urllib.request
from contextlib import closing, contextmanager
from typing import Any, BinaryIO, Iterable, Iterator

from shards.errors import CorruptDataError, ManifestError, MissingInputError
from shards.formats.locations import check_redirect, url_origin
from shards.formats import parallel_parts
from shards.formats.parallel_parts import DEFAULT_CONCURRENCY, DEFAULT_READ_AHEAD_BYTES, PartStream, pool_for

TIMEOUT_S = 60.0
MAX_REDIRECTS = 5
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(\d+)-(\d+)/(\d+|\*)\s*$")


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
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001 - urllib's signature
        self._check(fp, newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _request(location: str, origins: Iterable[str], headers: dict[str, str] | None = None,
             method: str = "GET") -> Any:
    """The response to a GET (or ``method``) of ``location`` (errors name it); redirects held to the allowed
    origins."""
    allowed = (*filter(None, [url_origin(location)]), *origins)
    request = urllib.request.Request(location, headers=headers or {}, method=method)
    try:
        return urllib.request.build_opener(_OriginRedirects(location, allowed)).open(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise MissingInputError("not found (HTTP 404)", path=location) from exc
        if 300 <= exc.code < 400:  # urllib's message for a redirect loop spans lines: keep its first
            first = (str(exc.reason).splitlines() or [""])[0]
            raise CorruptDataError(f"HTTP {exc.code}: redirect not followed ({first}; at most {MAX_REDIRECTS} "
                                   "hops are followed)", path=location) from exc
        raise CorruptDataError(f"HTTP {exc.code} {exc.reason}", path=location) from exc
    except (urllib.error.URLError, OSError) as exc:
        raise CorruptDataError(f"cannot open ({exc})", path=location) from exc


@contextmanager
def open_url(location: str, *, origins: Iterable[str] = ()) -> Iterator[BinaryIO]:
    """An ``http(s)`` location opened for sequential reading; errors name the location. ``origins``: where redirects
    may lead besides the location's own origin (a dataset's ``shards.formats.locations.request_origins``: its
    manifest's own and the caller's ``Remote(url_origins=...)``); any other target is a ``ManifestError``."""
    stream = _request(location, origins)
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


def fetch_range(location: str, start: int, stop: int, origins: Iterable[str] = ()) -> bytes:
    """Exactly bytes ``[start, stop)`` of ``location`` by one ranged GET (a server that answers otherwise, or
    with fewer bytes, is a ``CorruptDataError`` naming it)."""
    with closing(_request(location, origins, {"Range": f"bytes={start}-{stop - 1}"})) as response:
        answered = _content_range(response)
        if answered is None or answered[0] != start:
            raise CorruptDataError(f"the server did not answer the range request for bytes {start}-{stop - 1} "
                                   f"(HTTP {getattr(response, 'status', '?')})", path=location)
        try:
            data = response.read(stop - start)
        except (OSError, http.client.HTTPException) as exc:
            raise CorruptDataError(f"body broke at byte {start} ({type(exc).__name__}: {exc})",
                                   path=location) from exc
    if len(data) != stop - start:
        raise CorruptDataError(f"short read at byte {start} ({len(data)} of {stop - start} bytes)", path=location)
    return data


@contextmanager
def open_whole(location: str, *, origins: Iterable[str] = ()) -> Iterator[BinaryIO]:
    """The whole object at ``location``: where the server answers a range request (206 with its size), the first
    ``FIRST_PART`` bytes and then the rest in parallel parts (``shards.formats.parallel_parts``); otherwise the one
    stream of its 200 answer, as ``open_url``."""
    first_part = parallel_parts.FIRST_PART
    response = _request(location, origins, {"Range": f"bytes=0-{first_part - 1}"})
    answered = _content_range(response)
    if answered is None or answered[0] != 0 or answered[1] is None:
        try:
            yield response  # no ranges here (or a size not given): the whole body, in one stream
        finally:
            response.close()
        return
    with closing(response):
        head = response.read(first_part)
    size = answered[1]
    if size <= len(head):
        stream: Any = io.BytesIO(head)
    else:
        stream = io.BufferedReader(PartStream(_fetcher(location, origins), location, len(head), size,
                                              pool_for(DEFAULT_CONCURRENCY), head=head), 1 << 20)
    try:
        yield stream
    finally:
        stream.close()


_answers_ranges: dict[str, bool] = {}  # location -> its server says it answers range requests (asked once)


def accepts_ranges(location: str, origins: Iterable[str] = ()) -> bool:
    """Whether the server of ``location`` answers range requests (a HEAD says ``Accept-Ranges: bytes``), asked once
    per process and location; a server that refuses HEAD is read as one stream."""
    if location not in _answers_ranges:
        try:
            with closing(_request(location, origins, method="HEAD")) as response:
                answer = response.headers.get("Accept-Ranges", "").strip().lower() == "bytes"
        except CorruptDataError:
            answer = False
        _answers_ranges[location] = answer
    return _answers_ranges[location]


def _fetcher(location: str, origins: Iterable[str]):
    origins = tuple(origins)
    return lambda start, stop: fetch_range(location, start, stop, origins)


def open_parts(location: str, start: int, stop: int, origins: Iterable[str] = ()) -> PartStream:
    """Bytes ``[start, stop)`` of ``location`` in parallel ranged parts (the stream ``read_ahead`` opened for them,
    when there is one); only for a location whose server ``accepts_ranges``."""
    return parallel_parts.open_range(_fetcher(location, origins), location, start, stop, DEFAULT_CONCURRENCY)


def read_ahead(location: str, start: int, stop: int, origins: Iterable[str] = ()) -> bool:
    """Start ``[start, stop)`` of ``location`` now for a later ``open_parts``; False when the default read-ahead
    budget (``DEFAULT_READ_AHEAD_BYTES``) has no room."""
    return parallel_parts.read_ahead(_fetcher(location, origins), location, start, stop, DEFAULT_CONCURRENCY,
                                     DEFAULT_READ_AHEAD_BYTES)
