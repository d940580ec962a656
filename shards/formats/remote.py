"""Shard locations that are not local files: ``http(s)://`` URLs and ``pipe:`` shell commands.

HTTP goes through ``urllib`` (no ``curl`` needed); ``pipe:`` uses webdataset's opener, which runs the command and
reads its stdout, so any tool (``aws s3 cp ... -``, ``gsutil cat``) can feed shards. A remote tar is a stream:
reaching sample ``start`` reads through the samples before it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterator

from shards.errors import CorruptDataError, ManifestError, MissingInputError
from shards.formats.locations import REMOTE_SCHEMES, is_remote, shard_location  # noqa: F401 (re-exported)

TIMEOUT_S = 60.0


def join_location(base: str, relative: str) -> str:
    """A shard's location under ``base`` (see ``shards.formats.locations``: a manifest never yields a ``pipe:``)."""
    return shard_location(base, relative)


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
