"""Shard locations that are not local files: ``http(s)://`` URLs and ``pipe:`` shell commands.

HTTP goes through ``urllib`` (no ``curl`` needed); ``pipe:`` uses webdataset's opener, which runs the command and
reads its stdout, so any tool (``aws s3 cp ... -``, ``gsutil cat``) can feed shards. A remote tar is a stream:
reaching sample ``start`` reads through the samples before it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterator

from shards.errors import CorruptDataError, ManifestError, MissingInputError

REMOTE_SCHEMES = ("http://", "https://", "pipe:")
TIMEOUT_S = 60.0


def is_remote(location: str) -> bool:
    return str(location).startswith(REMOTE_SCHEMES)


def join_location(base: str, relative: str) -> str:
    """A shard's location: ``relative`` itself when it is already remote, else relative to ``base``."""
    if is_remote(relative):
        return relative
    if base.startswith("pipe:"):
        raise ManifestError("a pipe: location cannot hold relative shard paths", path=base)
    return urllib.parse.urljoin(base.rstrip("/") + "/", relative)


@contextmanager
def open_remote(location: str) -> Iterator[BinaryIO]:
    """Open a remote shard for sequential reading; errors name the location."""
    if location.startswith("pipe:"):
        from webdataset.gopen import gopen_pipe

        stream = gopen_pipe(location, "rb", bufsize=1 << 20)
    else:
        try:
            stream = urllib.request.urlopen(location, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise MissingInputError("not found (HTTP 404)", path=location) from exc
            raise CorruptDataError(f"HTTP {exc.code} {exc.reason}", path=location) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise CorruptDataError(f"cannot open ({exc})", path=location) from exc
    try:
        yield stream
    finally:
        stream.close()


def read_remote_json(location: str) -> Any:
    with open_remote(location) as stream:
        payload = stream.read()
    try:
        return json.loads(payload.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"not valid JSON ({exc})", path=location) from exc
