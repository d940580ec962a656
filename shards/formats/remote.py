"""Reading ``http(s)://`` locations: one stream per request, every redirect held to the allowed origins.

HTTP goes through ``urllib`` (no ``curl`` needed), following a redirect only to an allowed origin (the requested
URL's own, plus any the caller names), at most ``MAX_REDIRECTS`` hops: a server on an allowed origin cannot hand
the reader to another host (``shards.formats.locations.check_redirect``). The location kinds that use it are in
``shards.formats.location`` (docs/design.md, section 4).
"""

from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterable, Iterator

from shards.errors import CorruptDataError, ManifestError, MissingInputError
from shards.formats.locations import check_redirect, url_origin

TIMEOUT_S = 60.0
MAX_REDIRECTS = 5


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


@contextmanager
def open_url(location: str, *, origins: Iterable[str] = ()) -> Iterator[BinaryIO]:
    """An ``http(s)`` location opened for sequential reading; errors name the location. ``origins``: where redirects
    may lead besides the location's own origin (a dataset's ``shards.formats.locations.request_origins``: its
    manifest's own and the caller's ``Remote(url_origins=...)``); any other target is a ``ManifestError``."""
    allowed = (*filter(None, [url_origin(location)]), *origins)
    try:
        stream = urllib.request.build_opener(_OriginRedirects(location, allowed)).open(location, timeout=TIMEOUT_S)
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
    try:
        yield stream
    finally:
        stream.close()
