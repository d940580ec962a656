"""Ranged reads of objects on S3 (``shards.transport.s3``): ``open_range`` and what builds on it, with the retries
and the mid-body resume a shard reader needs.

- ``open_range``: a readable stream of exactly the bytes ``[start, stop)`` of an object, fetched by ranged GETs of
  up to ``RANGE_CHUNK`` bytes. 5xx, throttling (503 SlowDown), timeouts and connection resets are retried with
  exponential backoff and full jitter (``shards.transport.s3.backoff_delay``: the jitter is not seeded on purpose, it
  only spreads clients apart and never changes what is read); a body that breaks mid-read is re-requested from
  the byte where it stopped, so a long read never starts over. After ``max_attempts`` a ``CorruptDataError``
  names the URL and the last cause; 403 and 404 are final at once (``shards.transport.s3.final_error``). Each GET's
  body is read under the options' ``transfer_limits`` (``shards.transport.parallel_parts.TransferClock``): a server
  that dribbles is cut off, finally, with a ``CorruptDataError`` naming the URL.
- ``head_object``, ``read_object``, ``iter_chunks``: a size and metadata, a whole object, an object in pieces.
  Listing a prefix is ``shards.transport.listing``'s.

Kept apart from the client and its errors so that the byte bookkeeping of a resumed read reads on its own. The
client, the knobs (``RANGE_CHUNK``, ``BACKOFF_BASE_S``, ``BACKOFF_CAP_S``) and ``FETCH_STATS`` are looked up on
``shards.transport.s3`` at each use, so a value set there (a test shortening the backoff) takes effect here too.
``shards.transport.s3`` never imports this module: it is the core below both the ranged reads and the uploads.
"""

from __future__ import annotations

import io
import logging
import time
from typing import Any, Iterator

from shards.errors import CorruptDataError
from shards.transport import s3
from shards.transport.parallel_parts import TransferClock
from shards.transport.s3 import S3Options

log = logging.getLogger("shards.transport.s3")  # the logger these reads have always used


class RangeReader(io.RawIOBase):
    """Bytes ``[start, stop)`` of one object (``stop=None``: to its end), fetched lazily by ranged GETs.

    ``read(n)`` returns ``n`` bytes unless the range ends first. A failed request or a body that breaks is retried
    from the current byte (see the module docstring); ``where`` names the shard in errors when the URL alone does
    not. An object shorter than ``stop`` is a ``CorruptDataError``. ``chunk``: bytes per GET (default
    ``RANGE_CHUNK``; the first request of a parallel whole-object read asks for less).
    """

    def __init__(self, url: str, start: int = 0, stop: int | None = None, options: S3Options | None = None, *,
                 chunk: int | None = None):
        super().__init__()
        self.url = url
        self.bucket, self.key = s3.parse_s3_url(url)
        self.options = options if options is not None else S3Options()
        self.client = s3.make_client(self.options)
        self.position = start
        self.stop = stop
        self.size: int | None = None  # the object's size, once a response said it
        self._body: Any = None
        self._body_stop = start  # the body in flight covers [position, _body_stop)
        self._chunk = chunk
        self._retryable = s3.retryable_types()
        self._limits = self.options.transfer_limits()
        self._clock = TransferClock(self._limits, url)  # the GET in flight's

    def readable(self) -> bool:
        return True

    def _end(self) -> int | None:
        return self.stop if self.stop is not None else self.size

    def _request(self) -> None:
        """One GET for ``[position, min(end, position + chunk))``."""
        end = self._end()
        chunk = self._chunk or s3.RANGE_CHUNK
        chunk_stop = self.position + chunk if end is None else min(end, self.position + chunk)
        s3.FETCH_STATS.add(requests=1)
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.key,
                                              Range=f"bytes={self.position}-{chunk_stop - 1}")
        except s3.botocore_modules()[1].exceptions.ClientError as exc:
            if end is None and s3.status_and_code(exc)[0] == 416:  # reading to the end, and already there
                self.size, self._body_stop = self.position, self.position
                return
            raise
        total = str(response.get("ContentRange", "")).rpartition("/")[2]
        if total.isdigit():
            self.size = int(total)
        length = int(response.get("ContentLength", 0))
        if self.stop is not None and self.size is not None and self.size < self.stop:
            response["Body"].close()
            raise CorruptDataError(f"object is {self.size} bytes, expected at least {self.stop} (truncated or "
                                   "replaced)", path=self.url)
        self._body = response["Body"]
        self._body_stop = self.position + length
        self._clock = TransferClock(self._limits, self.url)

    def _close_body(self) -> None:
        if self._body is not None:
            try:
                self._body.close()
            except Exception:  # noqa: BLE001 (a broken connection may fail to close; it is dropped either way)
                pass
            self._body = None

    def _read_some(self, size: int) -> bytes:
        """Up to ``size`` bytes from the body in flight, opening the next GET when one is needed."""
        if self._body is None or self.position >= self._body_stop:
            self._close_body()
            self._request()
            if self._body_stop <= self.position:  # an empty object, or the end was reached
                return b""
        wanted = min(size, self._body_stop - self.position)
        # read1 on the urllib3 response returns what has arrived, so a body that breaks keeps every byte received
        # and the retry asks for the rest from exactly there; StreamingBody.read would drop a partial read.
        raw = getattr(self._body, "_raw_stream", None)
        read1 = getattr(raw, "read1", None)
        if read1 is not None:
            data = self._clock.read(read1, wanted)
        else:
            data = self._clock.read(self._body.read, min(wanted, 1 << 18))
        if not data:
            raise ConnectionResetError(f"body ended at byte {self.position}, expected up to {self._body_stop}")
        return data

    def read(self, size: int = -1) -> bytes:
        end = self._end()
        if size is None or size < 0:
            parts = []
            while chunk := self.read(s3.RANGE_CHUNK):
                parts.append(chunk)
            return b"".join(parts)
        if end is not None:
            size = min(size, end - self.position)
        parts, wanted = [], size
        attempt = 0
        while wanted > 0:
            try:
                data = self._read_some(wanted)
            except self._retryable as exc:
                self._close_body()
                if isinstance(exc, CorruptDataError):
                    raise  # this module's own verdict on the object (shorter than asked): a retry reads the same
                final = s3.final_error(exc, self.url)
                if final is not None:
                    raise final from None
                attempt += 1
                if attempt >= self.options.max_attempts:
                    raise CorruptDataError(f"gave up after {attempt} attempts at byte {self.position}; last cause: "
                                           f"{type(exc).__name__}: {s3.one_line(exc)}", path=self.url) from None
                delay = s3.backoff_delay(attempt - 1)
                log.debug("S3 read of %s failed at byte %d (%s); retry %d in %.2fs", self.url, self.position,
                          type(exc).__name__, attempt, delay)
                time.sleep(delay)
                continue
            if not data:
                break
            attempt = 0  # progress: a later failure gets a fresh set of attempts
            s3.FETCH_STATS.add(nbytes=len(data))
            self.position += len(data)
            wanted -= len(data)
            parts.append(data)
            end = self._end()
            if end is not None and self.position >= end:
                break
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self._close_body()
        super().close()


def open_range(url: str, start: int = 0, stop: int | None = None, options: S3Options | None = None) -> RangeReader:
    """A stream of bytes ``[start, stop)`` of ``url`` (``stop=None``: to the end); see ``RangeReader``."""
    return RangeReader(url, start, stop, options)


def head_object(url: str, options: S3Options | None = None) -> tuple[int, dict[str, str]]:
    """``(size, user metadata)`` of an object."""
    options = options if options is not None else S3Options()
    bucket, key = s3.parse_s3_url(url)
    client = s3.make_client(options)
    response = s3.retried_call(url, options, lambda: client.head_object(Bucket=bucket, Key=key))
    return int(response["ContentLength"]), dict(response.get("Metadata", {}))


def read_object(url: str, options: S3Options | None = None) -> bytes:
    """The whole object (ranged GETs, retried and resumed like ``open_range``)."""
    with open_range(url, 0, None, options) as stream:
        return stream.read()


def iter_chunks(url: str, options: S3Options | None = None, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The object in pieces of ``chunk`` bytes (streaming a whole shard: hashing, verifying)."""
    with open_range(url, 0, None, options) as stream:
        while data := stream.read(chunk):
            yield data
