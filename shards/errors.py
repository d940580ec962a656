"""Typed errors that carry the path (and sample key) so a batch job can print one clear line.

They subclass the built-ins callers already catch: bad input is a ``ValueError``, a missing file a
``FileNotFoundError``, corrupt data an ``OSError``. The CLI maps ``InputError`` to exit code 2 and every other
``ShardcacheError`` to exit code 1.
"""

from __future__ import annotations

import re

# ``scheme://`` (or ``scheme:/``, as a URL taken for a local path and normalised shows) then the userinfo up to the
# last ``@`` before the path, query, fragment or whitespace (a password may hold a raw ``@``; ``urllib.parse`` also
# splits the host at the last one).
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*:/{1,2})[^/?#\s@]*(?:@[^/?#\s@]*)*@")


def redact(text: str) -> str:
    """``text`` with the ``user:password@`` of every URL in it shown as ``***@``: a URL's credentials are never
    shown, wherever a location becomes text (an error line, a log line, a report, a recorded manifest). It lives
    here, at the bottom, because every error redacts its path and message, and the location layer uses the same
    rule."""
    return _USERINFO.sub(r"\1***@", text) if "@" in text else text


class ShardcacheError(Exception):
    """Base of every error shardcache raises on purpose."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None):
        # A URL's ``user:password@`` is never shown: every error line is redacted here, once for all callers.
        self.path = None if path is None else redact(str(path))
        self.key = key
        message = redact(str(message))
        self.reason = message  # the message without the path and key, for callers that re-raise with more context
        located = [part for part in (self.path, None if key is None else f"[sample {key}]") if part is not None]
        where = " ".join(located) + ": " if located else ""
        super().__init__(f"{where}{message}")


class InputError(ShardcacheError, ValueError):
    """The user's input or options are wrong (exit code 2); nothing was written."""


class MissingInputError(InputError, FileNotFoundError):
    """A file or folder the command needs does not exist."""


class ManifestError(InputError):
    """A manifest is missing, malformed, or of an unknown format or version."""


class OutputExistsError(InputError):
    """The output folder holds something different and ``--overwrite`` was not given."""


class StaleCacheError(InputError):
    """A feature cache was computed from a different dataset than the one now on disk."""


class CorruptDataError(ShardcacheError, OSError):
    """A shard or sample could not be read or decoded (exit code 1)."""


class ChecksumError(CorruptDataError):
    """A shard's bytes do not match the checksum in its manifest."""
