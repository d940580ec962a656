"""Shard locations that are not local files: ``http(s)://`` and ``s3://`` URLs, and ``pipe:`` shell commands.

HTTP goes through ``urllib`` (no ``curl`` needed); ``pipe:`` uses webdataset's opener, which runs the command and
reads its stdout, so any tool (``gsutil cat``) can feed shards. ``s3://`` goes through ``shards.formats.s3``
(ranged GETs, retried and resumed). A remote tar is a stream: reaching sample ``start`` reads through the samples
before it (on S3, a tar with a byte index reads only the slice: ``shards.formats.s3shards``).
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
def open_remote(location: str, storage_options: Any = None) -> Iterator[BinaryIO]:
    """Open a remote shard for sequential reading; errors name the location. ``storage_options``: for ``s3://``
    (``shards.formats.s3.S3Options`` or a mapping of its fields)."""
    if location.startswith("s3://"):
        import io

        from shards.formats.s3 import S3Options, open_range

        stream = io.BufferedReader(open_range(location, 0, None, S3Options.from_mapping(storage_options)), 1 << 20)
    elif location.startswith("pipe:"):
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


def read_remote_json(location: str, storage_options: Any = None) -> Any:
    with open_remote(location, storage_options) as stream:
        payload = stream.read()
    try:
        return json.loads(payload.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"not valid JSON ({exc})", path=location) from exc
