"""Typed errors that carry the path (and sample key) so a batch job can print one clear line.

They subclass the built-ins callers already catch: bad input is a ``ValueError``, a missing file a
``FileNotFoundError``, corrupt data an ``OSError``. The CLI maps ``InputError`` to exit code 2 and every other
``ShardcacheError`` to exit code 1.
"""

from __future__ import annotations


class ShardcacheError(Exception):
    """Base of every error shardcache raises on purpose."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None):
        self.path = None if path is None else str(path)
        self.key = key
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
