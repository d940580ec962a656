"""The node's shared view of its upcoming reads: each reader of a node cache publishes the shards it will read, and
eviction and prefetch (``shards.cache.eviction``, ``shards.cache.cached_shards``) read every live reader's plan
(docs/caching.md, "The shared plan").

The epoch order is a pure function of (seed, epoch, layout) (``shards.order.order``), so a reader knows its cached
shards for the rest of this epoch and all of the next before it reads one. Under ``<dir>/v1/plans/`` each reader (a
DataLoader worker, or a process reading in-process) keeps:

- ``<host>.<pid>.<token>.lock``, locked exclusively by the reader for as long as it lives. ``flock`` dies with its
  holder, so a plan whose lock can be taken without waiting belongs to a dead process (``kill -9`` included): it is
  ignored and removed by the next reader of the plans, as a killed fetch's reservation is.
- ``<host>.<pid>.<token>.plan``, JSON: the distinct cache keys (``keys``), the reads as indices into them (``reads``:
  one per run of reads of one shard, this epoch's first, then the next epoch's), how many of them are this
  epoch's (``epoch_reads``) and how many the reader has begun (``position``). It is replaced whole (temp file and
  rename) when the plan starts and each time the reader moves to its next shard, so no reader ever sees it torn.

Plans are untrusted: another job or user may write the folder. Each is read through the one door
(``shards.cache.node_locks.read_cache_json``: a regular file, not a link, at most ``MAX_PLAN_FILE_BYTES``) and its
shape checked field by field (``shards.door.shape``: counts are JSON integers in range, keys sha256 digests); one that
fails is ignored, with one warning per file for the life of the process (eviction reads the plans on every fetch).
A plan whose lock cannot be taken for any reason reads as live, and one whose files cannot be removed stays. A plan
holds at most ``MAX_PLAN_READS`` reads: beyond that a reader's future is unknown, which only makes its shards look
unneeded.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from shards.atomic import host_tag, write_json_atomic
from shards.cache.node_locks import SHA256_PATTERN, locked, open_locked, read_cache_json, unlink, warn_once
from shards.errors import ManifestError, MissingInputError, ShardcacheError
from shards.door.shape import as_int, as_int_list, as_list, as_object

log = logging.getLogger("shardcache.cache")

PLANS = "plans"
PLAN_FORMAT, PLAN_VERSION = "shardcache.cache-plan", 1
MAX_PLAN_READS = 1 << 16
MAX_PLAN_FILE_BYTES = 8 << 20  # 65,536 distinct keys of 70 bytes and their reads, with room to spare
_NAME = re.compile(r"^(?P<name>[A-Za-z0-9-]{1,32}\.\d{1,10}\.[0-9a-f]{8})\.plan\Z")


@dataclass(frozen=True)
class Plan:
    """One live reader's plan: ``reads`` (cache keys in read order) and the ``position`` of its current read."""

    reads: tuple[str, ...]
    position: int
    epoch_reads: int


class PlanPublisher:
    """One reader's plan file and the lock that keeps it alive (see the module docstring). One per stream (a
    thread's, ``shards.cache.cached_shards``); made again in a forked process, whose inherited lock would otherwise
    vouch for its parent."""

    def __init__(self, root: Path):
        folder = root / PLANS
        folder.mkdir(exist_ok=True)
        name = f"{host_tag()}.{os.getpid()}.{secrets.token_hex(4)}"
        self.path, self.lock_path = folder / f"{name}.plan", folder / f"{name}.lock"
        # Locked before the plan exists, so a plan file is never seen without its live lock.
        self._fd: int | None = open_locked(self.lock_path, fcntl.LOCK_EX)
        self._keys: list[str] = []
        self._reads: list[int] = []
        self._epoch_reads = 0
        self._position = -1

    def publish(self, this_epoch: Sequence[str], next_epoch: Sequence[str]) -> None:
        """A new plan: ``this_epoch``'s reads (one key per run of reads of one shard), then ``next_epoch``'s."""
        sequence = [*this_epoch[:MAX_PLAN_READS], *next_epoch[:max(0, MAX_PLAN_READS - len(this_epoch))]]
        index: dict[str, int] = {}
        self._reads = [index.setdefault(key, len(index)) for key in sequence]
        self._keys = list(index)
        self._epoch_reads = min(len(this_epoch), MAX_PLAN_READS)
        self._position = -1
        self.advance(0)

    def advance(self, position: int) -> None:
        """The reader has begun read ``position`` of its plan (that many before it are done)."""
        position = min(max(position, 0), len(self._reads))
        if position == self._position or self._fd is None:
            return
        self._position = position
        write_json_atomic(self.path, {"format": PLAN_FORMAT, "version": PLAN_VERSION, "keys": self._keys,
                                      "reads": self._reads, "epoch_reads": self._epoch_reads, "position": position})

    def finish_epoch(self) -> None:
        """This epoch's reads are over (or abandoned): only the next epoch's stay ahead."""
        self.advance(self._epoch_reads)

    def close(self) -> None:
        if self._fd is not None:
            unlink(self.path)
            unlink(self.lock_path)
            os.close(self._fd)
            self._fd = None


def live_plans(root: Path) -> list[Plan]:
    """Every live reader's plan under ``root`` (a cache's ``<dir>/v1``); the plans of dead readers are removed."""
    return _scan(root)[0]


def remove_dead_plans(root: Path) -> int:
    """Remove the plans of dead readers now (when a cache opens); how many there were."""
    return _scan(root)[1]


def _scan(root: Path) -> tuple[list[Plan], int]:
    folder = root / PLANS
    plans, removed = [], 0
    try:
        names = [entry.name for entry in os.scandir(folder)]
    except FileNotFoundError:
        return [], 0
    for name in names:
        match = _NAME.match(name)
        if not match:
            continue
        lock_path = folder / f"{match['name']}.lock"
        with locked(lock_path, fcntl.LOCK_EX | fcntl.LOCK_NB) as dead:
            if dead:  # no live holder: its reader is gone
                if unlink(folder / name) and unlink(lock_path):
                    removed += 1
                    log.debug("%s: removed the plan of a reader that is gone", folder / name)
                continue
        plan = read_plan(folder / name)
        if plan is not None:
            plans.append(plan)
    return plans, removed


def read_plan(path: Path) -> Plan | None:
    """The plan in ``path``, or None when it is gone or is not a plan (warned once per file: plans are untrusted)."""
    try:
        return _checked(read_cache_json(path, MAX_PLAN_FILE_BYTES), str(path))
    except MissingInputError:  # its reader finished and removed it
        return None
    except ShardcacheError as exc:
        warn_once(path, f"ignored a node-cache plan: {exc.reason}")
        return None


def _checked(value: Any, where: str) -> Plan:
    """The plan ``value`` holds, every field checked (``ManifestError`` naming the first that is wrong)."""
    plan = as_object(value, "the plan", where=where)
    if plan.get("format") != PLAN_FORMAT or plan.get("version") != PLAN_VERSION:
        raise ManifestError(f"not a {PLAN_FORMAT} of version {PLAN_VERSION}", path=where)
    keys = as_list(plan.get("keys"), "keys", max_len=MAX_PLAN_READS, where=where)
    for key in keys:
        if type(key) is not str or not SHA256_PATTERN.match(key):
            raise ManifestError(f"an item of keys is {repr(key)[:70]}: expected a sha256 (64 lowercase hex digits)",
                                path=where)
    reads = as_int_list(plan.get("reads"), "reads", hi=len(keys) - 1, max_len=MAX_PLAN_READS, where=where)
    epoch_reads = as_int(plan.get("epoch_reads"), "epoch_reads", hi=len(reads), where=where)
    position = as_int(plan.get("position"), "position", hi=len(reads), where=where)
    return Plan(tuple(keys[i] for i in reads), position, epoch_reads)


def next_uses(plans: Iterable[Plan]) -> dict[str, int] | None:
    """Per cache key, the fewest reads ahead of a live reader's position at which it is read (0: being read now),
    this epoch or the next; None when there is no live plan (the caller falls back to least recently used)."""
    aheads = [plan.reads[plan.position:] for plan in plans]
    if not aheads:
        return None
    # The reads at each distance across all plans, nearest last: a later write keeps the smaller distance. Column
    # by column in C (eviction asks on every fetch, and the forecast thousands of times an epoch); None pads.
    columns = list(itertools.zip_longest(*aheads))
    uses: dict[str, int] = {}
    for distance in range(len(columns) - 1, -1, -1):
        uses.update(zip(columns[distance], itertools.repeat(distance)))
    uses.pop(None, None)  # type: ignore[call-overload]
    return uses
