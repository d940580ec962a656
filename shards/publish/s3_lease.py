"""A writer's lease on an ``s3://`` prefix, so two publishers never interleave their objects under it.

Local output folders are guarded by ``flock`` (``shards.lock``); object storage has no locks, and two
``pack-shards --out s3://bucket/same`` from different staging folders used to upload over each other's shards and
publish a manifest naming the other's bytes. S3 conditional writes are a compare-and-swap on one object, enough
for a lease: ``<prefix>/.shardcache-lease.json`` names its holder, and only a request that saw the lease as it is
can replace it.

- ``acquire_lease``: ``PUT`` with ``If-None-Match: *``. When it exists: the holder is this writer (a create whose
  answer was lost) -> held; a live lease of another holder -> ``LeaseHeldError`` (exit 2, one line: who, since
  when, when it expires, and ``--break-lease``); an expired one, or any with ``break_lease`` -> ``PUT`` with
  ``If-Match`` on the ETag just read, so of two takers exactly one wins and the other reads again and refuses.
- Expiry is judged on the server's clock only: a lease expires ``ttl_s`` (recorded in it, ``LEASE_TTL_S`` = 10 min
  by default) after its ``Last-Modified``, compared with the ``Date`` of the response that read it; skewed client
  clocks do not matter (resolution: one second).
- ``Lease`` renews itself from a daemon thread every ``ttl_s / 3`` (``PUT`` with ``If-Match`` on its last ETag). A
  thread rather than renewing between uploads because one upload (a multi-GB shard on a slow link) may outlast the
  lease. A 412 means another writer took the lease: it is recorded as lost and ``check()`` (called by the publisher
  after every upload) raises ``LeaseLostError``; a renewal that fails for other reasons is retried every few
  seconds until the lease would have expired, and then counts as lost too. The publisher renews once more, in its
  own thread, right before writing the manifest.
- ``release``: ``DELETE`` with ``If-Match`` on the last ETag, after reading that the lease is still ours, so a
  writer never deletes its successor's lease.

The lease object is read as untrusted input: a malformed one is shown as held by "unknown" and expires
``LEASE_TTL_S`` after it was written; a recorded ``ttl_s`` outside (0, ``MAX_TTL_S``] counts as ``LEASE_TTL_S``.
"""

from __future__ import annotations

import contextlib
import datetime
import email.utils
import getpass
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from shards.door.bounded_read import parse_json
from shards.errors import MissingInputError, ShardcacheError
from shards.transport.s3 import S3PreconditionFailed, client_call, parse_s3_url
from shards.lock import OutputLockedError

log = logging.getLogger("shardcache.s3")

LEASE_NAME = ".shardcache-lease.json"
LEASE_FORMAT = "shardcache.lease"
LEASE_TTL_S = 600.0
MAX_TTL_S = 86400.0
RENEW_RETRY_S = 5.0  # after a failed renewal (network, 5xx), the next try comes this soon
_TAKE_ATTEMPTS = 3  # create / read / take over rounds before a lease that keeps changing is reported as held


class LeaseHeldError(OutputLockedError):
    """Another writer holds a live lease on the prefix (exit code 2, one line naming it)."""


class LeaseLostError(ShardcacheError):
    """This writer's lease was taken over (``--break-lease``, or it expired unrenewed): stop before the manifest."""


def lease_url(url: str) -> str:
    return url.rstrip("/") + "/" + LEASE_NAME


def _utc(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no $USER (containers)
        return str(os.getuid())


def new_holder(what: str) -> dict[str, Any]:
    """This writer's identity: user, host, pid and a random token (an identity, never used to choose anything)."""
    return {"user": _user(), "host": socket.gethostname(), "pid": os.getpid(), "token": os.urandom(8).hex(),
            "what": what}


@dataclass(frozen=True)
class LeaseState:
    """A lease as read from the server: who holds it and, on the server's clock, when it was written and now."""

    etag: str
    holder: Mapping[str, Any]
    ttl_s: float
    written: float  # Last-Modified, epoch seconds
    server_now: float  # the Date of the response that read it

    @property
    def expires(self) -> float:
        return self.written + self.ttl_s

    @property
    def expired(self) -> bool:
        return self.server_now >= self.expires

    def describe(self) -> str:
        """Who holds it: ``user alice, host node7, pid 4242 (publishing dataset.json), since <UTC time>``."""
        holder = self.holder
        who = ", ".join(f"{field} {holder[field]}" for field in ("user", "host", "pid") if field in holder)
        what, since = holder.get("what"), holder.get("since")
        return (f"{who or 'an unknown writer'}{f' ({what})' if isinstance(what, str) else ''}"
                f"{f', since {since}' if isinstance(since, str) else ''}")

    def describe_expiry(self) -> str:
        return (f"its lease expires {_utc(self.expires)} (in {max(0, round(self.expires - self.server_now))} s) "
                "unless renewed")


def _parse_state(body: bytes, etag: str, last_modified: datetime.datetime, headers: Mapping[str, str]) -> LeaseState:
    try:
        document = parse_json(body)
        holder = document["holder"] if isinstance(document.get("holder"), dict) else {}
        ttl_s = document.get("ttl_s")
    except (ValueError, AttributeError):  # not JSON, or not an object: someone else's bytes, shown as unknown
        holder, ttl_s = {}, None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= MAX_TTL_S:
        ttl_s = LEASE_TTL_S
    holder = {key: value for key, value in holder.items()  # shown in a one-line message: printable and short
              if isinstance(value, int) or (isinstance(value, str) and value.isprintable() and len(value) < 200)}
    try:
        server_now = email.utils.parsedate_to_datetime(headers["date"]).timestamp()
    except (KeyError, TypeError, ValueError):  # every S3 server sends Date; a proxy that drops it: our clock
        server_now = time.time()
    return LeaseState(etag, holder, float(ttl_s), last_modified.timestamp(), server_now)


def read_lease(client: Any, url: str) -> LeaseState | None:
    """The lease on the prefix ``url``, or None when there is none."""
    bucket, key = parse_s3_url(lease_url(url))
    try:
        response = client_call(lease_url(url), lambda: client.get_object(Bucket=bucket, Key=key))
    except MissingInputError:
        return None
    body = client_call(lease_url(url), lambda: response["Body"].read(64 << 10))
    return _parse_state(body, response["ETag"], response["LastModified"],
                        response["ResponseMetadata"].get("HTTPHeaders", {}))


def refuse_if_held(state: LeaseState | None, url: str, *, break_lease: bool, token: str | None = None) -> None:
    """``LeaseHeldError`` when ``state`` is a live lease of another writer than ``token`` and may not be broken."""
    if state is None or break_lease or state.expired or (token is not None and state.holder.get("token") == token):
        return
    raise LeaseHeldError(f"another process is writing here: {state.describe()}; {state.describe_expiry()}; wait "
                         "for it, or pass --break-lease to take it over", path=url)


class Lease:
    """A held lease, renewed by a daemon thread until ``release``. ``check()`` raises once it is lost."""

    def __init__(self, client: Any, url: str, holder: dict[str, Any], etag: str, ttl_s: float, taken_over: bool):
        self.client, self.url, self.holder, self.ttl_s = client, url, holder, ttl_s
        self.bucket, self.key = parse_s3_url(lease_url(url))
        self.etag = etag
        self.taken_over = taken_over  # from another writer (expired or broken): it may still be uploading
        self.lost: str | None = None
        self._valid_until = time.monotonic() + ttl_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="shardcache-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        if self.lost is not None:
            raise LeaseLostError(f"this writer's lease was lost ({self.lost}); nothing more is published, and the "
                                 "other writer's objects are left as they are", path=self.url)

    def renew(self) -> None:
        """Rewrite the lease if it is still ours (``If-Match``), restarting its ``ttl_s``; else mark it lost."""
        with self._lock:
            self.check()
            started = time.monotonic()
            body = _lease_body(self.holder, self.ttl_s)
            try:
                response = client_call(lease_url(self.url), lambda: self.client.put_object(
                    Bucket=self.bucket, Key=self.key, Body=body, IfMatch=self.etag, ContentType="application/json"))
                self.etag = response["ETag"]
            except S3PreconditionFailed:
                current = read_lease(self.client, self.url)
                if current is None or current.holder.get("token") != self.holder["token"]:
                    self.lost = ("taken over by " + current.describe() if current is not None
                                 else "the lease object was deleted")
                    self.check()
                self.etag = current.etag  # our own earlier write, whose answer was lost: renewed next time
                return
            except ShardcacheError as exc:
                if time.monotonic() >= self._valid_until:
                    self.lost = f"not renewed before it expired: {exc}"
                    self.check()
                raise
            self._valid_until = started + self.ttl_s

    def _renew_loop(self) -> None:
        wait = self.ttl_s / 3
        while not self._stop.wait(wait):
            try:
                self.renew()
                wait = self.ttl_s / 3
            except LeaseLostError:
                log.warning("%s: this writer's lease was lost (%s); stopping after the upload in progress",
                            self.url, self.lost)
                return
            except ShardcacheError as exc:
                log.warning("could not renew the lease on %s (retrying in %.0f s): %s", self.url, RENEW_RETRY_S, exc)
                wait = min(self.ttl_s / 3, RENEW_RETRY_S)

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours. Never raises: an unreleased lease expires."""
        self._stop.set()
        self._thread.join()
        if self.lost is not None:
            return
        with self._lock:
            try:
                current = read_lease(self.client, self.url)
                if current is not None and current.holder.get("token") == self.holder["token"]:
                    client_call(lease_url(self.url), lambda: self.client.delete_object(
                        Bucket=self.bucket, Key=self.key, IfMatch=current.etag))
            except ShardcacheError as exc:
                log.warning("could not release the lease %s (it expires within %.0f s): %s", lease_url(self.url),
                            self.ttl_s, exc)


def _lease_body(holder: Mapping[str, Any], ttl_s: float) -> bytes:
    now = _utc(time.time())
    return json.dumps({"format": LEASE_FORMAT, "version": 1, "holder": dict(holder), "ttl_s": ttl_s,
                       "renewed": now}, sort_keys=True).encode("utf-8")


def acquire_lease(client: Any, url: str, *, what: str, break_lease: bool = False,
                  ttl_s: float | None = None) -> Lease:
    """Take the lease on the prefix ``url`` (see the module docstring) and start renewing it."""
    ttl_s = LEASE_TTL_S if ttl_s is None else ttl_s
    holder = {**new_holder(what), "since": _utc(time.time())}
    bucket, key = parse_s3_url(lease_url(url))
    state = None
    for _ in range(_TAKE_ATTEMPTS):
        condition = {"IfNoneMatch": "*"} if state is None else {"IfMatch": state.etag}
        try:
            response = client_call(lease_url(url), lambda: client.put_object(
                Bucket=bucket, Key=key, Body=_lease_body(holder, ttl_s), ContentType="application/json",
                **condition))
        except S3PreconditionFailed:
            state = read_lease(client, url)
            if state is not None and state.holder.get("token") == holder["token"]:
                return Lease(client, url, holder, state.etag, ttl_s, taken_over=False)
            refuse_if_held(state, url, break_lease=break_lease, token=holder["token"])
            continue
        if state is not None:
            log.warning("%s: took over the lease of %s (%s)", url, state.describe(),
                        f"it expired {_utc(state.expires)}" if state.expired else "--break-lease")
        return Lease(client, url, holder, response["ETag"], ttl_s, taken_over=state is not None)
    refuse_if_held(state, url, break_lease=False)
    raise LeaseHeldError("another process is writing here: its lease changed on every attempt to take it; try "
                         "again", path=url)


@contextlib.contextmanager
def hold_lease(client: Any, url: str, *, what: str, break_lease: bool = False) -> Iterator[Lease]:
    """The lease for the duration of a ``with`` block, released at its end (also on errors and interrupts)."""
    lease = acquire_lease(client, url, what=what, break_lease=break_lease)
    try:
        yield lease
    finally:
        lease.release()


__all__ = ["LEASE_NAME", "LEASE_TTL_S", "Lease", "LeaseHeldError", "LeaseLostError", "LeaseState", "acquire_lease",
           "hold_lease", "lease_url", "new_holder", "read_lease", "refuse_if_held"]
