"""Resume audit: what a saved state says was fed and comes next, checked against the plan when it is loaded.

A saved state's batch count is only arithmetic (``shards.position.resume``): an off-by-one in it, an order changed
behind the loader's back (another seed reaching the order function) or a shard replaced by one of the same size
resumes silently into other batches than the interrupted run would have fed. So a loader's state also carries, under
``"audit"`` beside its fields (as ``"excluded"``), a record of keys:

- ``fed``: the last ``AUDIT_BATCHES`` batches the loader actually handed out before the saved position, their keys
  taken from the samples read for them (the key each slot's sample carried when it was read from its shard: a
  quarantined row's stand-in counts as its row, as ``lineage`` says), never recomputed from the plan;
- ``next``: the ``AUDIT_BATCHES`` batches the plan says come next, from the plan and the shards at save time;
- ``through``: how many batches of the epoch the loader had itself handed out (its own count, not the cursor's), so
  a position saved off by one is caught even where the keys of neighbouring batches agree;
- ``rank``: the rank that saved it (the batches are that rank's).

Each batch is ``{"step", "size", "keys"}``: its batch number in the epoch (from 0), its sample count and the
CRC-32 of each of its first ``AUDIT_SLOTS`` keys (base64 of little-endian ``uint32``). That is bounded (at most
``4 * AUDIT_SLOTS`` bytes per batch, ~22 KB for two batches of 1,024 samples each way) and names the first
mismatching key, not only the batch: the plan's key at the first slot whose hash differs. A batch larger than
``AUDIT_SLOTS`` is audited on its first ``AUDIT_SLOTS`` keys and its size.

On load, both lists are recomputed from the plan in the saved layout (``lineage.batch_rows``, the same order
function the loader runs) and the keys of those rows (``row_keys``: the split's column index, or the shards where
there is none); the first disagreement, in step order, is one line naming the epoch, batch, slot and key
(``ResumeAuditError``). The first batches fed after the resume, keys as read from the shards, are checked against
the plan the same way (``shards.loader.resume_audit``): a shard replaced behind the manifest's back shows there.
The record is untrusted input: ``audit_of`` checks every field's type and bound before anything uses it, and a
state without one (saved before the audit, or with it off) loads as "not audited".

Streams record what they read in a ``FedRing``: per logical worker, a ring of its last batches' key hashes in shared
memory, written by the worker (a DataLoader process, a thread, or the main process) as it reads each slot, read by
the main process when it saves. The loader side (which batch was handed out when, the live check of the first
batches after a resume) is ``shards.loader.resume_audit``.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from shards.door.shape import MAX_COUNT, as_int, as_list, as_object, as_str
from shards.errors import InputError
from shards.order.plan import shard_offsets
from shards.order.reads import CoveringReads
from shards.procs.values import SharedValues

AUDIT = "audit"  # a saved state's key, beside its fields
AUDIT_BATCHES = 2  # batches recorded each way: enough to name a shift or a swap, small enough to save every time
AUDIT_SLOTS = 1024  # keys hashed per batch
MAX_AUDIT_BATCHES = 8  # what a record may list each way (a state is untrusted)
MAX_AUDIT_RANKS = 1 << 17
MODES = ("refuse", "warn", "off")
OK, MISMATCH, NOT_AUDITED, OFF = "ok", "mismatch", "not audited", "off"
_HEADER = 4  # a ring entry: generation, epoch, worker batch, samples recorded; then the hashes


class ResumeAuditError(InputError):
    """A loaded state disagrees with the plan: what it says was fed, or what comes next, is not what the plan and
    the shards give now. One line, naming the first mismatching batch and key."""


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise InputError(f"resume_audit={mode!r} is not one of {', '.join(MODES)}")
    return mode


def key_hash(key: str | None) -> int:
    """A slot's hash: CRC-32 of the key's UTF-8 (-1: the key is unknown, a sample whose bytes were unreadable)."""
    if key is None:
        return -1
    return zlib.crc32(key.encode("utf-8", "surrogatepass"))


def key_hashes(keys: Sequence[str]) -> np.ndarray:
    return np.fromiter((key_hash(k) for k in keys[:AUDIT_SLOTS]), dtype=np.int64, count=min(len(keys), AUDIT_SLOTS))


def encode(hashes: np.ndarray) -> str:
    return base64.b64encode(np.asarray(hashes, dtype="<u4").tobytes()).decode("ascii")


@dataclass(frozen=True)
class AuditBatch:
    """One recorded batch: its number in the epoch (from 0), its sample count, the hashes of its first keys."""

    step: int
    size: int
    hashes: np.ndarray

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "size": self.size, "keys": encode(self.hashes)}


@dataclass(frozen=True)
class AuditRecord:
    rank: int
    through: int
    fed: tuple[AuditBatch, ...]
    next: tuple[AuditBatch, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "through": self.through, "fed": [b.to_dict() for b in self.fed],
                "next": [b.to_dict() for b in self.next]}


def audit_of(state: dict[str, Any]) -> AuditRecord | None:
    """The audit record of saved ``state`` (None: it has none), every field checked for type and bound: an
    ``InputError`` naming the field otherwise (``loader state audit.fed[1].keys ...``)."""
    record = state.get(AUDIT) if type(state) is dict else None
    if record is None:
        return None
    what = "loader state audit"
    record = as_object(record, what, error=InputError)
    unknown = sorted(set(record) - {"rank", "through", "fed", "next"})
    if unknown:
        raise InputError(f"{what} has {unknown[0]!r}, which is not an audit field")
    for name in ("rank", "through", "fed", "next"):
        if name not in record:
            raise InputError(f"{what} lacks {name}")
    rank = as_int(record["rank"], f"{what}.rank", hi=MAX_AUDIT_RANKS - 1, error=InputError)
    through = as_int(record["through"], f"{what}.through", error=InputError)
    lists = [tuple(_batch(item, f"{what}.{name}[{i}]") for i, item in
                   enumerate(as_list(record[name], f"{what}.{name}", max_len=MAX_AUDIT_BATCHES, error=InputError)))
             for name in ("fed", "next")]
    return AuditRecord(rank, through, *lists)


def _batch(item: Any, what: str) -> AuditBatch:
    item = as_object(item, what, error=InputError)
    if sorted(item) != ["keys", "size", "step"]:
        raise InputError(f"{what} must hold exactly step, size and keys")
    step = as_int(item["step"], f"{what}.step", error=InputError)
    size = as_int(item["size"], f"{what}.size", lo=1, hi=MAX_COUNT, error=InputError)
    slots = min(size, AUDIT_SLOTS)
    text = as_str(item["keys"], f"{what}.keys", max_len=4 * -(-4 * AUDIT_SLOTS // 3), error=InputError)
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise InputError(f"{what}.keys is not base64") from None
    if len(raw) != 4 * slots:
        raise InputError(f"{what}.keys holds {len(raw) // 4} key hashes; a batch of {size} has {slots}")
    return AuditBatch(step, size, np.frombuffer(raw, dtype="<u4").astype(np.int64))


def row_keys(dataset: Any, rows: Sequence[int]) -> list[str]:
    """The keys the plan gives global ``rows`` of ``dataset``'s split, in the order given: from the split's column
    index where it has one (``dataset.key_columns``: an index into a mapped array, checked against ``dataset.json``),
    else read from the shards now, as the stream reads scattered rows (``reads.CoveringReads`` with the dataset's
    ``merge_gap``): one read per run of near neighbours where a read can seek, one read of a shard's wanted span
    where every read walks the shard from its start (a tar shard without its byte index)."""
    rows = np.asarray(rows, dtype=np.int64)
    offsets = shard_offsets(dataset.shard_sizes)
    index = getattr(dataset, "key_columns", None)
    known = index.keys(rows, offsets) if index is not None else None
    if known is not None:
        return known
    wanted = np.unique(rows)
    keys: dict[int, str] = {}
    for piece, keep in CoveringReads(wanted, offsets, dataset.merge_gap):
        first = int(offsets[piece.shard]) + piece.start
        positions = set(range(piece.stop - piece.start)) if keep is None else set(keep.tolist())
        for offset, sample in zip(range(piece.stop - piece.start), dataset.read_slice(piece)):
            if offset in positions:
                keys[first + offset] = sample.key
    return [keys[row] for row in rows.tolist()]


def first_mismatch(recorded: AuditBatch, keys: Sequence[str]) -> tuple[int, str | None] | None:
    """``(slot, the plan's key there)`` of the first slot where ``recorded`` disagrees with the plan's ``keys`` for
    its batch (slot ``len(keys)`` and None when the batch sizes differ past the common slots), or None."""
    planned = key_hashes(keys)
    common = min(len(planned), len(recorded.hashes))
    differ = np.flatnonzero(planned[:common] != recorded.hashes[:common])
    if len(differ):
        slot = int(differ[0])
        return slot, keys[slot]
    if recorded.size != len(keys) or len(recorded.hashes) != len(planned):
        slot = common
        return slot, keys[slot] if slot < len(keys) else None
    return None


def mismatch_line(epoch: int, step: int, slot: int, key: str | None, what: str, size: int | None = None) -> str:
    """One line naming the epoch and batch (from 1, as training counts them), the slot and the plan's key."""
    where = f"epoch {epoch + 1}, batch {step + 1} of the epoch"
    if key is None:
        return f"resume audit: {where}: {what} has {size} samples where the plan has {slot}"
    return f"resume audit: {where}, sample {slot + 1}: {what} differs from the plan, whose key there is {key!r}"


class FedRing(SharedValues):
    """Per logical worker, the key hashes of its last ``depth`` batches, as the worker read them (``writer``), in
    shared memory so DataLoader worker processes, threads and the main process record alike. An entry is valid
    for one iteration (``new_iteration``: its generation), epoch and worker batch; the main process reads an entry
    twice-checked (``read``), so a batch the ring already overwrote is "not recorded", never a wrong one."""

    def __init__(self, workers: int, depth: int, slots: int):
        self.workers, self.depth, self.slots = max(1, workers), depth, slots
        self.entry = _HEADER + slots
        super().__init__("q", 1 + self.workers * depth * self.entry, lock=False)

    def new_iteration(self) -> None:
        self._array[0] += 1

    def writer(self, worker: int, epoch: int, batch_size: int) -> "FedWriter":
        """What stream ``worker`` of ``epoch`` records through."""
        return FedWriter(self, worker % self.workers, epoch, batch_size)

    def _base(self, worker: int, batch: int) -> int:
        return 1 + (worker * self.depth + batch % self.depth) * self.entry

    def read(self, worker: int, epoch: int, batch: int, size: int) -> np.ndarray | None:
        """The hashes worker ``worker``'s stream of ``epoch`` recorded for its ``batch``-th batch (from 0, since the
        stream started in this generation), if the ring still holds all ``size`` samples of it, else None."""
        array, base = self._array, self._base(worker % self.workers, batch)
        header = tuple(array[base:base + _HEADER])
        if header != (array[0], epoch, batch, size):
            return None
        hashes = np.asarray(array[base + _HEADER:base + _HEADER + min(size, self.slots)], dtype=np.int64)
        if tuple(array[base:base + _HEADER]) != header:  # overwritten while read
            return None
        return hashes


class FedWriter:
    """One stream's recorder: ``slot(key)`` for each slot it fills, in order (``shards.stream.worker_stream``).

    Its batches are the stream's own: every ``batch_size`` slots from where it started, as the DataLoader (or a
    thread) groups a worker's samples, numbered from 0 whatever the stream skipped. The main process counts which
    of them a handed batch is from its own round robin, never from the skip, so a skip that is off shows as batches
    holding other keys, not as batches left unrecorded."""

    def __init__(self, ring: FedRing, worker: int, epoch: int, batch_size: int):
        self.array, self.ring, self.worker, self.epoch = ring._array, ring, worker, epoch
        self.generation = ring._array[0]
        self.position, self.batch_size = 0, batch_size
        self.base = -1

    def slot(self, key: str | None) -> None:
        batch, slot = divmod(self.position, self.batch_size)
        array = self.array
        if slot == 0:
            self.base = base = self.ring._base(self.worker, batch)
            array[base] = -1  # invalid while the header is rewritten
            array[base + 1], array[base + 2], array[base + 3] = self.epoch, batch, 0
            array[base] = self.generation
        base = self.base
        if base >= 0:
            if slot < self.ring.slots:
                array[base + _HEADER + slot] = key_hash(key)
            array[base + 3] = slot + 1
        self.position += 1
