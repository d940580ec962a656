"""Resume state, in one place: what a loader saves (versioned layouts), how a saved state is checked against the
loader that continues it, and how a batch count becomes where each DataLoader worker's stream stopped.

Two layouts share one versioned record, ``LoaderState``, told apart by ``kind``: ``"stream"`` (a loader whose
samples flow through a DataLoader, ``shards.loader.worker_processes``, and a ``ShardDataset`` iterated on its own: a
batch count becomes per-worker skips) and ``"feature_batches"`` (the in-process run of a feature table,
``shards.loader.in_process``: batches over a full permutation, so a batch count is the position). Every rank of a
run consumes the same number of batches, so the state does not depend on the rank: rank 0's state continues every
rank.

A state continues its epoch bitwise exactly in the layout that saved it (world size, node count, workers, batch size,
``drop_last``); in another layout ``shards.position.elastic`` replays the saved one to find the samples left. A
state saved during such a continued epoch carries the state it continued (``prior``), so the chain replays again.

How the main process hands the ``Resume`` a batch count becomes, the epoch and the quarantine to DataLoader
workers (blocks of shared integers, since a worker's copy of the dataset would lose a plain attribute) is
``shards.position.shared_blocks``'s.
"""

from __future__ import annotations

import reprlib
from dataclasses import asdict, dataclass, fields
from typing import Any

from shards.errors import InputError
from shards.door.shape import MAX_COUNT, as_bool, as_int, as_list, as_number, as_object, as_str
from shards.order.plan import round_robin_consumed, worker_sample_counts
from shards.position.shared_blocks import MAX_QUARANTINED, Resume, check_quarantine_size
from shards.procs.values import MAX_WORKERS


# -- what a loader saves -------------------------------------------------------------------------------------------
LOADER_STATE_VERSION = 2
STREAM = "stream"
FEATURE_BATCHES = "feature_batches"
KINDS = (STREAM, FEATURE_BATCHES)
# What a saved state may hold (``check_record``). A state is untrusted input (docs/trust-model.md): each bound keeps
# a tampered field from making a resume loop or allocate without end, far above anything a real run saves.
MAX_EPOCH = 1 << 31
MAX_BATCH_SIZE = 1 << 24
MAX_WORLD_SIZE = 1 << 17  # an elastic replay deals the epoch to every saved rank: work grows with the world size
MAX_SEED = (1 << 64) - 1  # what torch.Generator.manual_seed takes
MAX_PRIOR_DEPTH = 32  # layout changes within one epoch, each nesting the state it continued
MAX_CLASSES = 1 << 20
MAX_KEY_CHARS = 4096
# Settings a resumed run must share with the saved one, in the order they are checked; the layout (world size,
# nodes, workers, batch size, drop_last) may change (``shards.position.elastic``).
COMPATIBLE = ("kind", "seed", "dataset", "sampling")


@dataclass(frozen=True)
class LoaderState:
    """A loader's position: ``batches`` of ``epoch`` handed out, and the settings that make the count meaningful.

    ``split_batch`` is the unit the epoch plan split each rank's share between workers in (the batch size for a
    DataLoader's stream; 1 for a loader that deals samples one by one). ``dataset`` fingerprints the shard sizes,
    ``sampling`` the order settings (shuffle, buffer, class weights, the dataset's drop_last). ``prior``: the state
    this epoch continued in another layout (its batches count from ``prior["batches"]``). ``quarantined``: the
    samples kept out of every epoch (``shards.loader.watchdog``) as ``[[global row, key], ...]``, None when there are
    none. ``nodes``: the node count of the epoch plan's node affinity (1: none). A saved state holds every field
    (``check_record``); ``None`` in a setting of a state made in code means it is not checked.
    """

    kind: str
    epoch: int
    batches: int
    batch_size: int | None
    num_workers: int | None
    drop_last: bool | None
    seed: int | None
    world_size: int | None
    split_batch: int | None = 1
    dataset: str | None = None
    sampling: dict[str, Any] | None = None
    prior: dict[str, Any] | None = None
    nodes: int = 1
    quarantined: list | None = None
    version: int = LOADER_STATE_VERSION

    def __post_init__(self) -> None:
        """A cheap sanity check for states made in code; a saved one is checked field by field in ``from_dict``."""
        if self.kind not in KINDS:
            raise InputError(f"loader state kind must be one of {list(KINDS)}, got {self.kind!r}")
        if self.epoch < 0 or self.batches < 0:
            raise InputError(f"loader state epoch and batches must be non-negative, got epoch={self.epoch}, "
                             f"batches={self.batches}")
        if self.nodes < 1:
            raise InputError(f"loader state nodes must be at least 1, got {self.nodes}")

    def to_dict(self) -> dict[str, Any]:
        """Plain numbers, booleans, strings, lists and dicts: loadable with ``torch.load(weights_only=True)``."""
        return asdict(self)

    @property
    def node_count(self) -> int:
        """The nodes the epoch plan dealt shards to."""
        return self.nodes

    @property
    def logical_workers(self) -> int:
        return max(1, self.num_workers or 0)

    def layout(self) -> tuple:
        """What decides which samples a batch count covers; two states with the same layout resume exactly."""
        split = self.split_batch if self.logical_workers > 1 else 1  # one worker: the split unit changes nothing
        # The node count orders the shards, so another one is a resume of the remainder.
        return self.world_size, self.logical_workers, self.batch_size, self.drop_last, split, self.node_count

    def same_layout(self, other: LoaderState) -> bool:
        return all(a is None or b is None or a == b for a, b in zip(self.layout(), other.layout()))

    @property
    def prior_state(self) -> LoaderState | None:
        return None if self.prior is None else LoaderState.from_dict(self.prior)

    @property
    def layout_batches(self) -> int:
        """Batches handed out in this state's own layout (after those of the state it continued)."""
        return self.batches - (self.prior["batches"] if self.prior is not None else 0)

    @classmethod
    def from_dict(cls, state: Any) -> LoaderState:
        """Read a saved state of this version (any other version, or none, is refused, not guessed at), every
        field checked for type and range, the ``prior`` chain included (``check_record``)."""
        return cls(**check_record(state))


# -- reading a saved state: the one validator ----------------------------------------------------------------------
def check_record(state: Any) -> dict[str, Any]:
    """The fields of saved state ``state`` (as ``LoaderState.to_dict`` wrote it, from ``load_state_dict``, DCP, a
    checkpoint or a run's events: untrusted), each checked for type and range, or an ``InputError`` naming the
    field (``loader state prior.batches is 2.5: expected an integer``).

    Types are exact (``"7"``, ``2.5``, ``True``, ``NaN`` or ``None`` where an integer belongs are refused, never
    converted) and every count bounded, so no field can make a resume loop or allocate without end; the
    ``prior`` chain is walked iteratively, at most ``MAX_PRIOR_DEPTH`` deep, and each state it continued must
    belong to the same epoch, settings and kind, with no more batches. What only the loader can check (the batch
    count against the epoch's batches in the saved layout, the quarantined rows against the split) is checked
    where the state is continued (``Cursor.load``, ``elastic.remaining_after``). The door that calls this for a
    loaded state also checks the rows each stream left out and the audit record (``elastic.SavedState``)."""
    checked = _own_fields(state, "")
    path, level = "", checked
    for _ in range(MAX_PRIOR_DEPTH):
        if level["prior"] is None:
            return checked
        path += "prior."
        prior = _own_fields(level["prior"], path)
        _check_continued(prior, level, path)
        level = prior
    raise InputError(f"loader state {path}prior: a state may continue at most {MAX_PRIOR_DEPTH} others (one per "
                     f"layout change within an epoch); this one goes deeper")


def _own_fields(record: Any, path: str) -> dict[str, Any]:
    """One state's fields, checked; ``prior`` only for being an object (``check_record`` walks the chain)."""
    record = as_object(record, f"loader state {path}".rstrip("."), error=InputError)
    version = record.get("version")
    if type(version) is not int or version != LOADER_STATE_VERSION:
        raise InputError(f"loader state {path}version {reprlib.repr(version)} is not one this shardcache reads (it "
                         f"reads version {LOADER_STATE_VERSION}); resume with the version that saved it")
    names = [f.name for f in fields(LoaderState) if f.name != "version"]
    missing = [n for n in names if n not in record]
    if missing:
        where = f"loader state {path}".rstrip(".")
        raise InputError(f"{where} of version {version} lacks {', '.join(missing)}")

    def name(field_name: str) -> str:
        return f"loader state {path}{field_name}"

    def count(field_name: str, lo: int, hi: int) -> int:
        return as_int(record[field_name], name(field_name), lo=lo, hi=hi, error=InputError)

    kind = as_str(record["kind"], name("kind"), error=InputError)
    if kind not in KINDS:
        raise InputError(f"{name('kind')} must be one of {list(KINDS)}, got {reprlib.repr(kind)}")
    world_size = count("world_size", 1, MAX_WORLD_SIZE)
    nodes = count("nodes", 1, world_size)
    if world_size % nodes:
        raise InputError(f"{name('nodes')} is {nodes}: it must divide world_size={world_size}")
    prior = record["prior"]
    return dict(
        kind=kind, epoch=count("epoch", 0, MAX_EPOCH), batches=count("batches", 0, MAX_COUNT),
        batch_size=count("batch_size", 1, MAX_BATCH_SIZE), num_workers=count("num_workers", 0, MAX_WORKERS),
        drop_last=as_bool(record["drop_last"], name("drop_last"), error=InputError),
        seed=count("seed", 0, MAX_SEED), world_size=world_size,
        split_batch=count("split_batch", 1, MAX_BATCH_SIZE),
        dataset=as_str(record["dataset"], name("dataset"), max_len=64, error=InputError),
        sampling=_sampling(record["sampling"], name("sampling")),
        prior=None if prior is None else as_object(prior, name("prior"), error=InputError),
        nodes=nodes, quarantined=_quarantined(record["quarantined"], name("quarantined")))


def _check_continued(prior: dict[str, Any], state: dict[str, Any], path: str) -> None:
    """A state a layout change continued: the same epoch, kind and settings, and no more batches."""
    for setting in ("epoch", *COMPATIBLE):
        if prior[setting] != state[setting]:
            raise InputError(f"loader state {path}{setting} differs from the state that continued it: it was not "
                             "saved by shardcache")
    if prior["batches"] > state["batches"]:
        raise InputError(f"loader state {path}batches is {prior['batches']}, more than the {state['batches']} of "
                         "the state that continued it")


# The settings ``elastic.sampling_settings`` writes: those always present, and those recorded only when set.
SAMPLING_ALWAYS = ("shuffle", "shuffle_buffer", "class_weights", "drop_last")
SAMPLING_WHEN_SET = ("rotate_every", "feature_window")


def _sampling(value: Any, what: str) -> dict[str, Any]:
    settings = as_object(value, what, error=InputError)
    unknown = [key for key in settings if key not in SAMPLING_ALWAYS + SAMPLING_WHEN_SET]
    if unknown:
        raise InputError(f"{what} has {reprlib.repr(unknown[0])}, which is not a sampling setting")
    missing = [key for key in SAMPLING_ALWAYS if key not in settings]
    if missing:
        raise InputError(f"{what} lacks {', '.join(missing)}")
    for key in ("shuffle", "drop_last"):
        as_bool(settings[key], f"{what}.{key}", error=InputError)
    as_int(settings["shuffle_buffer"], f"{what}.shuffle_buffer", error=InputError)
    for key in SAMPLING_WHEN_SET:
        if key in settings:
            as_int(settings[key], f"{what}.{key}", lo=1, error=InputError)
    weights = settings["class_weights"]
    if weights is not None:
        for index, weight in enumerate(as_list(weights, f"{what}.class_weights", max_len=MAX_CLASSES,
                                               error=InputError)):
            as_number(weight, f"{what}.class_weights[{index}]", lo=0, error=InputError)
    return settings


def _quarantined(record: Any, what: str) -> list | None:
    if record is None:
        return None
    for index, item in enumerate(as_list(record, what, max_len=MAX_QUARANTINED, error=InputError)):
        pair = as_list(item, f"{what}[{index}]", max_len=2, error=InputError)
        if len(pair) != 2:
            raise InputError(f"{what}[{index}] must be a [row, key] pair")
        as_int(pair[0], f"{what}[{index}] row", error=InputError)
        as_str(pair[1], f"{what}[{index}] key", max_len=MAX_KEY_CHARS, error=InputError)
    return record


def check_compatible(saved: LoaderState, current: LoaderState) -> None:
    """Refuse to continue ``saved`` with a loader whose data or order would give its batch count another meaning."""
    for name in COMPATIBLE:
        value, ours = getattr(saved, name), getattr(current, name)
        if value is not None and value != ours:
            if name == "dataset":
                raise InputError("loader state dataset: the saved state was taken on another dataset (its shard "
                                 "sizes differ); resume on the dataset it was saved with")
            raise InputError(f"loader state {name}: the saved state has {name}={_short(value)} but this loader has "
                             f"{name}={_short(ours)}; resume with the same setting")


def _short(value: Any) -> str:
    """A value for a one-line message: as is when short, else cut (a saved ``sampling`` may list many weights)."""
    text = str(value)
    return text if len(text) <= 80 else reprlib.repr(value)


def quarantine_record(quarantine: dict[int, str]) -> list[list[Any]]:
    """The quarantined samples as a state records them: ``[[global row, key], ...]``, sorted by row."""
    check_quarantine_size(len(quarantine))
    return [[int(row), str(key)] for row, key in sorted(quarantine.items())]



def consumed_batches(batches_consumed: int | None, handed_out: int) -> int:
    """The position to save: by default what the loader handed out; a caller whose consumer lags behind (a
    prefetch thread draws ahead of the training step) says how many it really used."""
    if batches_consumed is None:
        return handed_out
    if type(batches_consumed) is not int or not 0 <= batches_consumed <= handed_out:
        raise InputError(f"batches_consumed must be an integer in 0..{handed_out} (the batches this loader has "
                         f"handed out this epoch), got {batches_consumed!r}")
    return batches_consumed


# -- from a batch count to per-worker skips --------------------------------------------------------------------------
def worker_batches(samples_per_rank: int, num_workers: int, batch_size: int, drop_last: bool,
                   split_batch: int = 1) -> list[int]:
    """Batches each (logical) worker yields: DataLoader batches per worker, so each may end with a partial one
    (with whole-batch splits, ``split_batch == batch_size``, only one worker of a rank does)."""
    counts = worker_sample_counts(samples_per_rank, max(1, num_workers), split_batch)
    if drop_last:
        return [n // batch_size for n in counts]
    return [-(-n // batch_size) for n in counts]


def worker_consumed(samples_per_rank: int, position: LoaderState) -> tuple[list[int], int]:
    """Samples each logical worker had consumed after ``position.layout_batches`` batches, and which worker's batch
    comes next."""
    workers, split = position.logical_workers, position.split_batch or 1
    taken, next_worker = round_robin_consumed(
        worker_batches(samples_per_rank, workers, position.batch_size, position.drop_last, split),
        position.layout_batches)
    counts = worker_sample_counts(samples_per_rank, workers, split)
    return [min(n, t * position.batch_size) for n, t in zip(counts, taken)], next_worker


def stream_resume(position: LoaderState, samples_per_rank: int, *, remainder: bool = False) -> Resume:
    """What each worker skips to continue ``position``, and which worker's batch comes next."""
    skips, next_worker = worker_consumed(samples_per_rank, position)
    return Resume(position.epoch, tuple(skips), rotation=next_worker, remainder=remainder)
