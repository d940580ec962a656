"""The run record: the contract between a training run and every reader of its folder (docs/design.md, "Runs").

``train`` writes a run folder; ``shards report`` and ``shards lineage`` read it without importing ``train``
(``shards`` depends on no other package). So what a folder holds is defined here, once, for both sides:

- the file names (everyone imports them from here);
- ``EpochRow``, one ``metrics.jsonl`` line: a versioned record written with ``asdict`` and read back field by field
  through the untrusted-input door (``shards.door.shape``), so a bad line is one error naming the file and line;
  besides the numbers it holds the findings the loop made (``wait_advice``, ``straggler``...), which the report
  renders as recorded instead of applying the rules again;
- ``run.json`` (``RunRecord``): the data side of the run as the ``open_dataset`` and ``make_loader`` calls it made,
  in plain JSON (``DataCall``), so the train loader can be rebuilt from the record alone (``shards.check.lineage``).

The data events of a run (layouts, exclusions, quarantines, restarts) are appended beside it by
``shards.data_events``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from shards.atomic import atomic_output, write_json_atomic
from shards.door.bounded_read import read_json_file, read_regular_file
from shards.door.jsonlines import json_lines
from shards.door.shape import MAX_COUNT, as_bool, as_int, as_list, as_object, as_str, field as get
from shards.errors import ManifestError

CONFIG_FILE = "config.json"  # train's own config (train.config.TrainConfig), read back by a resume
RECORD_FILE = "run.json"  # RunRecord: the data calls, for lineage
METRICS_FILE = "metrics.jsonl"  # one EpochRow per line
EVENTS_FILE = "data-events.jsonl"  # shards.data_events: rank 0's file; other ranks' beside it
KEYS_FILE = "keys.jsonl"  # --record-keys: the keys each step was fed
CURVES_FILE = "curves.png"
REPORT_FILE = "report.html"
SCALE_FILE = "feature-scale.json"  # the train split's feature mean and std, when standardising
LAST_FILE = "last.pt"
BEST_FILE = "best.pt"
MODEL_FILE = "model.pt"
CHECKPOINT_FILES = (LAST_FILE, BEST_FILE, MODEL_FILE)
# A key list a layout left out, copied into the run folder under a name from its sha256 (kept_keys_name), so
# lineage reads the list a layout used even after the original changes, and never a path outside the folder.
KEPT_KEYS_FILE = re.compile(r"^exclude-keys-[0-9a-f]{16}\.txt\Z")
RUN_FILES = (CONFIG_FILE, RECORD_FILE, METRICS_FILE, EVENTS_FILE, KEYS_FILE, CURVES_FILE, REPORT_FILE, SCALE_FILE,
             *CHECKPOINT_FILES)



def kept_keys_name(sha256: str) -> str:
    return f"exclude-keys-{sha256[:16]}.txt"


RUN_FORMAT = "shardcache.run"
RUN_VERSION = 1
ROW_VERSION = 1
MAX_WORLD = 1 << 16  # ranks, workers and nodes a record may name: lineage builds a loader per rank


def _real(value: Any, what: str, *, where: str | None) -> float:
    """A recorded measurement: an int or a float, NaN and infinities included (a diverged epoch's loss is NaN)."""
    if type(value) not in (int, float):
        raise ManifestError(f"{what} is {value!r:.40}: expected a number", path=where)
    return value


def _count(value: Any, what: str, *, where: str | None) -> int:
    return as_int(value, what, where=where)


# What each kind of EpochRow field holds, by its annotation: ``X | None`` is X or absent.
_SHAPES: dict[str, Callable[..., Any]] = {"int": _count, "float": _real, "str": as_str, "bool": as_bool,
                                          "dict": as_object, "list": as_list}


@dataclass(frozen=True)
class EpochRow:
    """One epoch of a run as ``metrics.jsonl`` holds it. A field that is None was not measured in this run (a
    regression run has no top-1, one process no slowest rank) and is left out of the line."""

    epoch: int
    version: int = ROW_VERSION
    step: int | None = None
    lr: float | None = None
    train_loss: float | None = None
    train_top1: float | None = None
    val_loss: float | None = None
    val_samples: int | None = None
    val_top1: float | None = None
    val_top5: float | None = None
    val_per_class_accuracy: dict | None = None
    val_confusion: list | None = None
    val_mse: float | None = None
    val_mae: float | None = None
    val_r2: float | None = None
    samples_per_s: float | None = None
    data_wait_share: float | None = None
    epoch_time_s: float | None = None
    cache_hit_rate: float | None = None
    fetched_bytes: int | None = None
    cache: dict | None = None  # every node-cache counter of the epoch, and ideal_bytes
    quarantined: int | None = None  # samples kept out so far
    stage_seconds: dict | None = None  # summed over ranks
    stage_seconds_by_rank: list | None = None
    slowest_rank: int | None = None  # under DDP: the epoch's slowest rank (train.run.diagnose) and every rank's
    slowest_rank_cause: str | None = None  # "data" or "compute"
    slowest_rank_wait_s: float | None = None
    slowest_rank_step_s: float | None = None
    others_wait_s: float | None = None
    others_step_s: float | None = None
    slowest_rank_wait_ratio: float | None = None
    rank_wait_s: list | None = None
    rank_step_s: list | None = None
    mixture_drawn: list | None = None  # samples each source filled
    first_batch: list | None = None  # the starts and resumes of this epoch (train.run.first_batch)
    # The train loader's run mode: {"mode": ...}; with Auto also its "trial" (per candidate: mode, batches timed,
    # mean step_s and wait_s) and the mode "chosen" (None until every candidate was tried).
    run_mode: dict | None = None
    # Rank 0's loader memory in flight over the epoch (train.run.meter.MemoryTrace): its process tree's PSS plus
    # /dev/shm ("bytes", "start_bytes", "peak_flight_bytes") and the training process's own PSS ("main_bytes"),
    # sampled at "t_s" seconds with each interval's "wait_share", and the "budget_bytes" it was held to. Absent
    # where the kernel gives no PSS.
    memory: dict | None = None
    probe: dict | None = None  # --head logreg's fit
    # The storage forecast of this epoch's train reads (``shards.forecast.run.epoch_forecast``, made once as the run
    # started: requests, bytes, cache counters, first_batch_s, cost) and what the run measured of the same reads,
    # summed over ranks (requests and bytes sent to object storage, the train reader's node-cache counters).
    forecast: dict | None = None
    storage: dict | None = None
    # The findings the loop made (train.run.diagnose), rendered as recorded by the report:
    wait_advice: str | None = None  # the data pipeline held the epoch back, and what to change
    straggler: str | None = None  # the slowest rank, in words
    straggler_warning: str | None = None  # a rank held the others back for data over the last epochs
    # What a person should conclude from the epoch (chance-level accuracy, one class, loss at ln C, the data
    # pipeline): [{"rule", "level", "text"}], worst first; the run report opens with the last epoch's.
    verdicts: list | None = None

    def to_json(self) -> dict[str, Any]:
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}

    @classmethod
    def from_json(cls, value: Any, what: str, where: str | None = None) -> "EpochRow":
        """A parsed line, checked field by field; ``what`` names it (``line 3``) in the error."""
        row = as_object(value, what, where=where)
        version = get(row, "version", what, where=where)
        if type(version) is not int or version != ROW_VERSION:
            raise ManifestError(f"{what} has version {version!r:.20}; this shardcache reads version {ROW_VERSION}",
                                path=where)
        unknown = sorted(set(row) - set(_ROW_FIELDS))
        if unknown:
            raise ManifestError(f"{what} has unknown field {unknown[0]!r:.40}", path=where)
        as_int(get(row, "epoch", what, where=where), f"{what}: epoch", lo=1, where=where)
        for name, value in row.items():
            if value is not None or name in ("epoch", "version"):
                _ROW_FIELDS[name](value, f"{what}: {name}", where=where)
        return cls(**row)


_ROW_FIELDS = {item.name: _SHAPES[str(item.type).partition(" | ")[0]] for item in dataclasses.fields(EpochRow)}


def row_problem(value: Any, what: str) -> str | None:
    """Why a parsed line is not an ``EpochRow``, or None: the report leaves such a line out and says so."""
    try:
        EpochRow.from_json(value, what)
    except ManifestError as exc:
        return exc.reason
    return None


def write_rows(path: str | os.PathLike, rows: Iterable[EpochRow]) -> None:
    """Rewrite ``metrics.jsonl`` whole and atomically (from the history a checkpoint keeps, so a resume never
    duplicates lines)."""
    text = "".join(json.dumps(row.to_json(), sort_keys=True) + "\n" for row in rows)
    with atomic_output(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def read_rows(path: str | os.PathLike, *, problems: list[str] | None = None) -> list[EpochRow]:
    """Every line of ``metrics.jsonl`` as an ``EpochRow``. The first bad line is a ``ManifestError`` naming the
    file and the line (a resume must not continue from a history it cannot read), unless ``problems`` is given:
    then each bad line is left out and said there, one line each (the report shows what it can)."""
    where = str(path)
    try:
        text = read_regular_file(path, error=ManifestError).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=where) from None
    rows = []
    for number, value, why in json_lines(text):
        try:
            if why is not None:
                raise ManifestError(f"line {number} is not a JSON object ({why})", path=where)
            rows.append(EpochRow.from_json(value, f"line {number}", where))
        except ManifestError as exc:
            if problems is None:
                raise
            problems.append(f"{Path(where).name} {exc.reason}; left out")
    return rows


# The parts of a recorded ``open_dataset`` call and the fields each holds (the option records of
# ``shards.stream.options``, ``shards.select.mixture`` and ``shards.image.transforms``, as plain JSON).
OPEN_FIELDS = ("path", "sources", "split", "transform", "seed", "return_keys", "sampling", "decode", "remote",
               "distributed", "mix")
SOURCE_FIELDS = ("path", "weight", "repeat", "choose", "subset", "source")
SUBSET_FIELDS = ("classes", "keys", "where", "max_samples")
# ``mode``: the run mode's JSON form (``RunMode.to_json``); ``workers``: the bare worker count of older records.
LOADER_FIELDS = ("batch_size", "drop_last", "mode", "workers")


def _plain(value: Any) -> Any:
    """An option record as JSON: a dataclass as its fields, tuples as lists."""
    if dataclasses.is_dataclass(value):
        return {item.name: _plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def _subset(subset: Any) -> dict[str, Any] | None:
    """A mixture source's subset; the keys it leaves out are the layout's to say (``shards.data_events``)."""
    if subset.empty:
        return None
    where = getattr(subset.where, "expression", subset.where)
    if callable(where) or not (subset.keys is None or isinstance(subset.keys, (str, os.PathLike))):
        raise ValueError("a run records its subset as values: a callable filter or a set of keys cannot be recorded")
    return {"classes": None if subset.classes is None else list(subset.classes),
            "keys": None if subset.keys is None else os.fspath(subset.keys), "where": where,
            "max_samples": subset.max_samples}


@dataclass(frozen=True)
class LoaderCall:
    """The train loader's ``make_loader`` arguments that decide what a step is fed, as ``DataCall.of`` records
    them (``mode``: the loader's run mode, recorded in its JSON form)."""

    batch_size: int
    drop_last: bool
    mode: Any

    def to_json(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "drop_last": self.drop_last, "mode": self.mode.to_json()}


@dataclass(frozen=True)
class DataCall:
    """The train split's ``open_dataset(**open_dataset)`` and ``make_loader(**make_loader)`` as a run made them,
    in plain values. Steering that does not change which samples a step is fed (caches, stall recovery, pinned
    memory) is not recorded; what a resume may change (world size, workers, the key list left out) is the layout
    events' to say (``shards.data_events``)."""

    open_dataset: dict[str, Any]
    make_loader: dict[str, Any]

    @classmethod
    def of(cls, path: Any, split: str, *, transform: Any, seed: int, return_keys: bool, sampling: Any, decode: Any,
           remote: Any, distributed: Any, mix: Any, loader: LoaderCall) -> "DataCall":
        """The record of a call with these arguments (``path``: a folder, or the mixture's ``SourceSpec``s;
        ``loader``: the ``make_loader`` arguments)."""
        sources = None
        if not isinstance(path, (str, os.PathLike)):
            sources = [{"path": s.path, "weight": s.weight, "repeat": s.repeat, "choose": s.choose,
                        "subset": _subset(s.subset), "source": s.source} for s in path]
        call = {"path": None if sources else os.fspath(path), "sources": sources, "split": split,
                "transform": None if transform is None else _plain(transform), "seed": seed,
                "return_keys": return_keys, "sampling": _plain(sampling),
                "decode": {"mode": decode.mode, "draft": decode.draft},
                "remote": {"base_url": remote.base_url, "url_origins": list(remote.url_origins),
                           "storage_options": _plain(remote.storage_options)},
                "distributed": {"world_size": distributed.world_size, "nodes": distributed.nodes,
                                "rotate_every": distributed.rotate_every},
                "mix": _plain(mix)}
        return cls(call, loader.to_json())

    @property
    def run_mode(self) -> Any:
        """What ``RunMode.parse`` reads the recorded mode from: its JSON form, or an older record's worker
        count (``WorkerProcesses(n)``, 0 ``InProcess()``, as ``--workers`` meant it)."""
        loader = self.make_loader
        return loader["mode"] if "mode" in loader else loader["workers"]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any, where: str) -> "DataCall":
        """The shapes a reader relies on; the values inside each option record are checked by that record when
        it is made again (``shards.check.lineage``)."""
        data = as_object(value, "data", where=where)
        call = _fields(get(data, "open_dataset", "data", where=where), "data.open_dataset", OPEN_FIELDS, where)
        loader = _fields(get(data, "make_loader", "data", where=where), "data.make_loader", LOADER_FIELDS, where)
        what = "data.open_dataset"
        if (call.get("path") is None) == (call.get("sources") is None):
            raise ManifestError(f"{what} names neither a path nor sources, or both", path=where)
        if call.get("path") is not None:
            as_str(call["path"], f"{what}.path", where=where)
        for index, source in enumerate(as_list(call.get("sources") or [], f"{what}.sources", max_len=MAX_WORLD,
                                               where=where)):
            source = _fields(source, f"{what}.sources[{index}]", SOURCE_FIELDS, where)
            as_str(get(source, "path", f"{what}.sources[{index}]", where=where), f"{what}.sources[{index}].path",
                   where=where)
            if source.get("subset") is not None:
                _fields(source["subset"], f"{what}.sources[{index}].subset", SUBSET_FIELDS, where)
            if source.get("source") is not None:
                as_str(source["source"], f"{what}.sources[{index}].source", where=where)
        as_str(get(call, "split", what, where=where), f"{what}.split", where=where)
        as_int(get(call, "seed", what, where=where), f"{what}.seed", lo=-MAX_COUNT, where=where)
        as_bool(get(call, "return_keys", what, where=where), f"{what}.return_keys", where=where)
        for name in ("sampling", "decode", "remote", "distributed", "mix"):
            as_object(get(call, name, what, where=where), f"{what}.{name}", where=where)
        if call.get("transform") is not None:
            as_object(call["transform"], f"{what}.transform", where=where)
        as_int(get(loader, "batch_size", "data.make_loader", where=where), "data.make_loader.batch_size", lo=1,
               where=where)
        as_bool(get(loader, "drop_last", "data.make_loader", where=where), "data.make_loader.drop_last", where=where)
        if ("mode" in loader) == ("workers" in loader):
            raise ManifestError("data.make_loader names neither a run mode nor a worker count, or both", path=where)
        if "mode" in loader:
            mode = as_object(loader["mode"], "data.make_loader.mode", where=where)
            as_str(get(mode, "kind", "data.make_loader.mode", where=where), "data.make_loader.mode.kind",
                   where=where)
        else:
            as_int(loader["workers"], "data.make_loader.workers", hi=MAX_WORLD, where=where)
        return cls(call, loader)


def _fields(value: Any, what: str, known: tuple[str, ...], where: str) -> dict[str, Any]:
    record = as_object(value, what, where=where)
    unknown = sorted(set(record) - set(known))
    if unknown:
        raise ManifestError(f"{what} has unknown field {unknown[0]!r:.40} (it records {', '.join(known)})",
                            path=where)
    return record


@dataclass(frozen=True)
class RunRecord:
    """``run.json``: what a start (or resume) of the run fed it. Rewritten at every start; the layouts of
    ``data-events.jsonl`` say what each start changed (world size, workers, exclusions)."""

    data: DataCall
    epochs: int  # the epochs the train loader is iterated, as the latest start asked
    # The loaders' memory budget as this start resolved it (bytes, source, ranks on the node, read-ahead sized from
    # it: ``shards.loader.budget.MemoryBudget.record``): steering, so beside the data call, not in it.
    memory_budget: dict[str, Any] | None = None
    format: str = RUN_FORMAT
    version: int = RUN_VERSION

    def write(self, folder: str | os.PathLike) -> None:
        record = {"format": self.format, "version": self.version, "epochs": self.epochs, "data": self.data.to_json()}
        if self.memory_budget is not None:
            record["memory_budget"] = self.memory_budget
        write_json_atomic(Path(folder) / RECORD_FILE, record)

    @classmethod
    def read(cls, folder: str | os.PathLike) -> "RunRecord":
        """``run.json`` of ``folder``, checked; anything else is one ``ManifestError`` naming the file."""
        where = str(Path(folder) / RECORD_FILE)
        data = as_object(read_json_file(where), "the run record", where=where)
        if data.get("format") != RUN_FORMAT:
            raise ManifestError(f"format {data.get('format')!r:.40} is not {RUN_FORMAT!r}", path=where)
        version = data.get("version")
        if type(version) is not int or version != RUN_VERSION:
            raise ManifestError(f"version {version!r:.20} is not one this shardcache reads ({RUN_VERSION})",
                                path=where)
        epochs = as_int(get(data, "epochs", "the run record", where=where), "epochs", lo=1, where=where)
        budget = data.get("memory_budget")
        if budget is not None:
            budget = as_object(budget, "memory_budget", where=where)
        return cls(DataCall.from_json(get(data, "data", "the run record", where=where), where), epochs, budget)


def is_run_folder(folder: Path) -> bool:
    """A run has finished an epoch (metrics.jsonl) or at least started (its run record)."""
    return (folder / METRICS_FILE).is_file() or (folder / RECORD_FILE).is_file()

