"""Object storage (``s3://bucket/prefix``): the options, the client, URLs, the counters and the typed errors.

Everything S3 goes through botocore (``pip install 'shardcache[s3]'``): signing, the AWS configuration chain
(environment, ``~/.aws/config`` and ``credentials``, profiles, ``AWS_ENDPOINT_URL`` for MinIO, Ceph, R2 or
SeaweedFS) and connection pooling. This module adds what a shard reader needs on top:

- ``S3Options``: the caller's choices (endpoint, profile, region, unsigned access, attempts, timeouts, and how slow
  a server may be: ``transfer_limits``, which ``http(s)://`` locations read under too). It never holds
  credentials, so it can be logged, pickled to DataLoader workers and recorded in a config.
- ``make_client``: one client per process and options. Clients are not fork-safe, so the cache is keyed by the
  process id: a DataLoader worker builds its own after fork.
- The retry policy of every request: ``retryable_types`` (what may be retried), ``backoff_delay`` (exponential
  backoff with full jitter, ``random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt))``) and
  ``final_error``: 403 (``S3AccessDenied``, an ``InputError``) and 404 (``MissingInputError``) are final at once,
  and so is 412 (``S3PreconditionFailed``: a conditional write lost). The ranged reads built on this policy
  (``open_range``, ``head_object``, ``read_object``, ``iter_chunks``) live in ``shards.transport.s3_ranges``, above
  this module. ``retried_call`` makes one request under that policy (a HEAD, a page of a listing: every reader and
  writer lists through ``shards.transport.listing``); ``client_call`` makes one unretried request (uploads, deletes,
  the writer's lease) with the same typed errors.
- ``FETCH_STATS``: bytes and requests of this process (``share_stats()`` makes DataLoader workers add to the same
  counters), for the benchmark and the tests.

Messages name the URL and what the server said, never a credential: ``S3Options`` holds none, and botocore's error
responses carry only a code and a message.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import threading
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from shards.errors import CorruptDataError, InputError, MissingInputError
from shards.jobs.parallel import start_context
from shards.transport.parallel_parts import (
    DEFAULT_CONCURRENCY, DEFAULT_MIN_RATE, DEFAULT_RATE_WINDOW_S, DEFAULT_READ_AHEAD_BYTES,
    DEFAULT_REQUEST_DEADLINE_S, TransferLimits)
from shards.units import parse_size

log = logging.getLogger(__name__)

SCHEME = "s3://"
EXTRA_HINT = "pip install 'shardcache[s3]'"
RANGE_CHUNK = 64 << 20  # one GET covers at most this many bytes; a longer range is several GETs in a row
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 5.0
MAX_POOL_CONNECTIONS = 16
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-_]{1,254}\Z")
_DENIED = {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled",
           "InvalidToken", "ExpiredToken", "AccountProblem"}
_MISSING = {"NoSuchKey", "404", "NotFound", "NoSuchBucket"}
_CREDENTIAL_WORDS = ("key", "secret", "token", "password", "credential")


class S3AccessDenied(InputError, PermissionError):
    """403: the credentials (or their absence) do not allow the request. Not retried."""


class S3PreconditionFailed(CorruptDataError):
    """412 (or AWS's 409 ``ConditionalRequestConflict``): a conditional write or delete (``If-Match``,
    ``If-None-Match: *``) found the object in another state than the writer last saw. Not retried: the caller
    reads the object again and decides (``shards.publish.s3_lease``, the manifest write in ``s3_upload``)."""


@dataclass(frozen=True)
class S3Options:
    """How to reach object storage. ``endpoint_url=None`` lets botocore's chain decide (``AWS_ENDPOINT_URL``,
    ``endpoint_url`` in ``~/.aws/config``, else AWS); ``profile`` picks a profile of ``~/.aws/config``;
    ``unsigned=True`` sends anonymous requests (public buckets). ``max_concurrency``: requests in flight per
    process for the parts of long reads (``shards.transport.parallel_parts``); ``read_ahead_bytes``: how many bytes of
    the coming covering reads a reader may have in flight ahead of the one it reads (0: none).
    ``min_transfer_rate`` (bytes per second, or ``"1K"``; 0: none), ``rate_window_s`` and ``request_deadline_s``:
    how slow a server may be before a request is cut off, for ``s3://`` and ``http(s)://`` alike
    (``transfer_limits``; docs/object-storage.md, "Slow servers"). Credentials are never options: they come from
    the AWS chain (environment, ``~/.aws/credentials``, the profile, instance roles)."""

    endpoint_url: str | None = None
    profile: str | None = None
    region: str | None = None
    unsigned: bool = False
    max_attempts: int = 8
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    max_concurrency: int = DEFAULT_CONCURRENCY
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES
    min_transfer_rate: int | str = DEFAULT_MIN_RATE
    rate_window_s: float = DEFAULT_RATE_WINDOW_S
    request_deadline_s: float = DEFAULT_REQUEST_DEADLINE_S

    def __post_init__(self) -> None:
        for name in ("endpoint_url", "profile", "region"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InputError(f"S3Options.{name}={value!r} must be a non-empty string or None")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise InputError(f"S3Options.endpoint_url={self.endpoint_url!r} must start with http:// or https://")
        if not isinstance(self.unsigned, bool):
            raise InputError(f"S3Options.unsigned={self.unsigned!r} must be True or False")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise InputError(f"S3Options.max_attempts={self.max_attempts!r} must be an integer >= 1")
        if isinstance(self.max_concurrency, bool) or not isinstance(self.max_concurrency, int) or not (
                1 <= self.max_concurrency <= 64):
            raise InputError(f"S3Options.max_concurrency={self.max_concurrency!r} must be an integer from 1 to 64")
        ahead = self.read_ahead_bytes
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise InputError(f"S3Options.read_ahead_bytes={self.read_ahead_bytes!r} must be an integer >= 0 (0: no "
                             "read-ahead)")
        object.__setattr__(self, "min_transfer_rate",
                           parse_size(self.min_transfer_rate, "S3Options.min_transfer_rate"))
        for name in ("connect_timeout_s", "read_timeout_s", "rate_window_s", "request_deadline_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise InputError(f"S3Options.{name}={value!r} must be a positive number of seconds")

    @classmethod
    def from_mapping(cls, storage_options: "S3Options | Mapping[str, Any] | None") -> "S3Options":
        """``storage_options`` as given to ``open_dataset`` (None, a mapping of field names, or ``S3Options``)."""
        if storage_options is None:
            return cls()
        if isinstance(storage_options, cls):
            return storage_options
        if not isinstance(storage_options, Mapping):
            raise InputError(f"storage_options must be a mapping or S3Options, not {type(storage_options).__name__}")
        known = {f.name for f in fields(cls)}
        for name in storage_options:
            if any(word in str(name).lower() for word in _CREDENTIAL_WORDS):
                raise InputError(f"storage_options[{name!r}]: credentials are not options; they come from the AWS "
                                 "chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, a profile)")
            if name not in known:
                raise InputError(f"storage_options[{name!r}] is not one of {', '.join(sorted(known))}")
        return cls(**dict(storage_options))

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def transfer_limits(self) -> TransferLimits:
        """How slow a server may be before a request is cut off (``shards.transport.parallel_parts``)."""
        return TransferLimits(int(self.min_transfer_rate), float(self.rate_window_s), float(self.request_deadline_s))


# -- URLs -------------------------------------------------------------------------------------------------------------
def is_s3(location: object) -> bool:
    return str(location).startswith(SCHEME)


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` -> ``("bucket", "some/key")`` (the key may be empty: a bucket's root)."""
    if not is_s3(url):
        raise InputError(f"{url!r} is not an s3:// URL")
    bucket, _, key = str(url)[len(SCHEME):].partition("/")
    if not _BUCKET.match(bucket):
        raise InputError(f"{url!r}: {bucket!r} is not a bucket name")
    return bucket, key


def join_s3(base: str, name: str) -> str:
    """``s3://bucket/prefix`` + ``train-000000.tar``; ``name`` is a checked relative shard name."""
    return base.rstrip("/") + "/" + name


# -- the client -------------------------------------------------------------------------------------------------------
def botocore_modules():
    """``(boto3, botocore)``, imported on first use so that a local-only install never needs them."""
    try:
        import boto3
        import botocore.config
        import botocore.exceptions
    except ImportError:
        raise InputError(f"s3:// locations need boto3: {EXTRA_HINT}") from None
    return boto3, botocore


_clients: dict[tuple[int, S3Options], Any] = {}
# Sessions outlive fork: a DataLoader worker makes its client from the parent's session, whose loaded service
# model makes that ~10 ms instead of ~100 ms per worker and epoch (clients and their connections stay per process).
_sessions: dict[tuple[str | None, str | None], Any] = {}
_clients_lock = threading.Lock()


def make_client(options: S3Options | None = None) -> Any:
    """The boto3 S3 client for ``options`` in this process (made once; a forked worker makes its own)."""
    options = options if options is not None else S3Options()
    key = (os.getpid(), options)
    client = _clients.get(key)
    if client is not None:
        return client
    boto3, botocore = botocore_modules()
    for name in ("botocore", "boto3", "urllib3"):  # their INFO lines ("Found credentials in ...") are noise here
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            config = botocore.config.Config(
                signature_version=botocore.UNSIGNED if options.unsigned else None,
                connect_timeout=options.connect_timeout_s, read_timeout=options.read_timeout_s,
                retries={"total_max_attempts": 1, "mode": "standard"},  # this module retries, resuming bodies
                max_pool_connections=max(MAX_POOL_CONNECTIONS, options.max_concurrency))
            try:
                session = _sessions.get((options.profile, options.region))
                if session is None:
                    session = boto3.session.Session(profile_name=options.profile, region_name=options.region)
                    _sessions[(options.profile, options.region)] = session
                client = session.client("s3", endpoint_url=options.endpoint_url, config=config)
            except botocore.exceptions.ProfileNotFound as exc:
                raise InputError(f"AWS profile {options.profile!r} not found ({exc})") from None
            except botocore.exceptions.BotoCoreError as exc:
                raise InputError(f"cannot configure the S3 client: {one_line(exc)}") from None
            for stale in [k for k in _clients if k[0] != key[0]]:
                del _clients[stale]  # inherited from the parent across fork: never used here
            _clients[key] = client
    return client


def forget_clients() -> None:
    """Drop this process's sessions and clients, so the next request reads the AWS configuration again (after a
    change of environment credentials or config files in a long-lived process)."""
    with _clients_lock:
        _clients.clear()
        _sessions.clear()


# -- counters ---------------------------------------------------------------------------------------------------------
class FetchStats:
    """Bytes received and GET/HEAD requests sent by this process (or, after ``share()``, by it and its forks)."""

    def __init__(self) -> None:
        self._bytes: Any = None
        self._requests: Any = None
        self._local = [0, 0]
        self._lock = threading.Lock()  # the parts of a parallel read count from several threads

    def share(self) -> None:
        context = start_context()  # the workers' start method: forked workers inherit the counters
        self._bytes = context.Value("q", self._local[0])
        self._requests = context.Value("q", self._local[1])

    def add(self, nbytes: int = 0, requests: int = 0) -> None:
        if self._bytes is None:
            with self._lock:
                self._local[0] += nbytes
                self._local[1] += requests
            return
        if nbytes:
            with self._bytes.get_lock():
                self._bytes.value += nbytes
        if requests:
            with self._requests.get_lock():
                self._requests.value += requests

    @property
    def bytes(self) -> int:
        return self._local[0] if self._bytes is None else self._bytes.value

    @property
    def requests(self) -> int:
        return self._local[1] if self._requests is None else self._requests.value

    def reset(self) -> None:
        self._local = [0, 0]
        if self._bytes is not None:
            self._bytes.value = 0
            self._requests.value = 0


FETCH_STATS = FetchStats()
# A part thread of the parent may hold the lock at the moment of a fork: the child starts with a free one.
os.register_at_fork(after_in_child=lambda: setattr(FETCH_STATS, "_lock", threading.Lock()))


def share_stats() -> None:
    """Count the bytes of DataLoader workers (forked after this call) in ``FETCH_STATS`` too."""
    FETCH_STATS.share()


# -- errors -----------------------------------------------------------------------------------------------------------
def one_line(exc: BaseException) -> str:
    """``exc`` as one line of at most 300 characters, for an error message."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def status_and_code(exc: BaseException) -> tuple[int | None, str]:
    """The HTTP status and the S3 error code of a botocore ``ClientError`` (``(None, "")`` for anything else)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status, str(response.get("Error", {}).get("Code", ""))


def final_error(exc: BaseException, url: str) -> Exception | None:
    """The typed error for a failure that retrying cannot fix, else None (retry)."""
    _, botocore = botocore_modules()
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return InputError("no AWS credentials found (environment, ~/.aws/credentials or a profile); for a public "
                          "bucket use unsigned access (--s3-unsigned, storage_options={'unsigned': True})", path=url)
    if isinstance(exc, botocore.exceptions.ClientError):
        status, code = status_and_code(exc)
        if code in _DENIED or status == 403:
            return S3AccessDenied(f"access denied (HTTP 403 {code or 'Forbidden'}); check the credentials, profile "
                                  "and endpoint, or --s3-unsigned for a public bucket", path=url)
        if code in _MISSING or status == 404:
            return MissingInputError(f"not found (HTTP 404 {code or 'NotFound'})", path=url)
        if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
            return S3PreconditionFailed(f"precondition failed (HTTP {status} {code}): the object changed since it "
                                        "was read", path=url)
        if status == 416 or code == "InvalidRange":
            return CorruptDataError("the object is shorter than the manifest says (HTTP 416)", path=url)
        if status is not None and status < 500 and status not in (408, 429) and code not in (
                "SlowDown", "RequestTimeout", "Throttling", "ThrottlingException", "RequestTimeTooSkewed"):
            return CorruptDataError(f"HTTP {status} {code}: {one_line(exc)}", path=url)
        return None
    if isinstance(exc, (botocore.exceptions.ParamValidationError, botocore.exceptions.NoRegionError)):
        return InputError(f"bad S3 request: {one_line(exc)}", path=url)
    return None


def client_call(url: str, call: Callable[[], Any]) -> Any:
    """One S3 request, not retried (writes; reads and listings retry: ``retried_call``): a failure becomes the
    typed error ``final_error`` gives it, else a ``CorruptDataError`` naming the URL and the cause."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 (botocore raises many types; each is mapped or wrapped below)
        final = final_error(exc, url)
        if final is not None:
            raise final from None
        raise CorruptDataError(f"S3 request failed: {type(exc).__name__}: {one_line(exc)}", path=url) from None


def retried_call(url: str, options: S3Options, call: Callable[[], Any]) -> Any:
    """One S3 request (``call``) retried under the policy above, up to ``options.max_attempts`` times: a final
    failure raises its typed error at once, the last retryable one becomes a ``CorruptDataError`` naming ``url``."""
    retryable = retryable_types()
    for attempt in range(options.max_attempts):
        try:
            FETCH_STATS.add(requests=1)
            return call()
        except retryable as exc:
            final = final_error(exc, url)
            if final is not None:
                raise final from None
            if attempt + 1 >= options.max_attempts:
                raise CorruptDataError(f"gave up after {attempt + 1} attempts; last cause: {type(exc).__name__}: "
                                       f"{one_line(exc)}", path=url) from None
            time.sleep(backoff_delay(attempt))
    raise AssertionError("unreachable")


def retryable_types() -> tuple[type[BaseException], ...]:
    """The exception types a retried request catches; ``final_error`` then decides which of them are final."""
    _, botocore = botocore_modules()
    import urllib3.exceptions

    return (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, urllib3.exceptions.HTTPError, OSError)


def backoff_delay(attempt: int) -> float:
    """Seconds before retry ``attempt + 1`` (full jitter, unseeded on purpose: it never changes what is read)."""
    return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** attempt))

