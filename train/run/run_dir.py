"""The run folder: what it holds, and whether a new run may start in it, continue it, or must refuse.

``RUN_DIR`` holds ``config.json``, ``metrics.jsonl``, ``curves.png``, ``last.pt``, ``best.pt``, ``model.pt``. A folder
that holds a different run, or anything that is not a run, is never touched without ``--overwrite``, which then
removes only the files of the run it replaces (none in a folder that holds no run) and refuses to write over a
file with one of a run's names that no run there wrote (``shards.jobs.owned``). The same decision is computed on every
rank (read-only), so an error stops all ranks alike instead of leaving some waiting.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from shards.atomic import atomic_output, write_json_atomic
from shards.door.bounded_read import read_json_file, read_regular_file
from shards.data_events import EVENTS_FILE  # layouts, exclusions, quarantines, restarts
from shards.errors import ManifestError, OutputExistsError
from shards.door.jsonlines import json_lines
from shards.jobs.owned import refuse_clobber, remove_owned
from shards.report.run import is_run_folder, metrics_row_problem
from shards.door.shape import MAX_COUNT, as_bool, as_int, as_list, as_number, as_object, as_str, field as get
from train.config import TrainConfig

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
LAST_FILE = "last.pt"
BEST_FILE = "best.pt"
MODEL_FILE = "model.pt"
REPORT_FILE = "report.html"  # shards.report.build.write_run_report, redrawn as epochs end (at most every 30 s) and at the end
KEYS_FILE = "keys.jsonl"  # --record-keys (train.run.lineage)
SCALE_FILE = "feature-scale.json"  # the train split's feature mean and std, when standardising (train.model.standardize)
RUN_FILES = (CONFIG_FILE, METRICS_FILE, CURVES_FILE, LAST_FILE, BEST_FILE, MODEL_FILE, REPORT_FILE, EVENTS_FILE,
             KEYS_FILE, SCALE_FILE)


@dataclass(frozen=True)
class RunPlan:
    """What to do with the folder: start fresh (clearing the replaced run's files when overwriting) or resume."""

    folder: Path
    resume_from: Path | None
    clear: tuple[str, ...] = ()  # the files of the run that --overwrite replaces

    def path(self, name: str) -> Path:
        return self.folder / name


def read_run_config(path: Path, advice: str = "") -> TrainConfig:
    """A run's ``config.json``, read back from an untrusted folder (a resume, ``shards lineage``): every field of
    the type ``TrainConfig`` declares, the sources and subset of a mixture too, then ``TrainConfig``'s own checks;
    any failure is one ``ManifestError`` naming the file and the field (``advice`` ends its message)."""
    try:
        return TrainConfig.from_dict(config_shape(read_json_file(path), str(path)))
    except (ValueError, TypeError) as exc:  # a ManifestError is a ValueError: its reason is kept
        raise ManifestError(f"not a readable run config ({getattr(exc, 'reason', exc)}){advice}",
                            path=str(path)) from exc


def _signed(value: Any, what: str, *, where: str | None) -> int:
    return as_int(value, what, lo=-MAX_COUNT, where=where)  # ranges are TrainConfig's to check (a seed may be < 0)


# The shape of each annotation ``TrainConfig`` uses, by its type's name; ``X | None`` is X or null.
_FIELD_SHAPES: dict[str, Callable[..., Any]] = {"int": _signed, "float": as_number, "bool": as_bool, "str": as_str,
                                                 "dict": as_object, "list": as_list}


# A mixture's parts as config.json records them (train.cli.data_sources, --classes/--keys/--where/--max-samples).
SOURCE_FIELDS = ("path", "weight", "repeat", "choose")
SUBSET_FIELDS = ("classes", "keys", "where", "max_samples")


def _record(value: Any, what: str, fields: tuple[str, ...], where: str) -> dict[str, Any]:
    """A recorded source or subset: an object of ``fields`` only (a null one is absent)."""
    record = as_object(value, what, where=where)
    unknown = sorted(set(record) - set(fields))
    if unknown:
        raise ManifestError(f"{what} has unknown field {unknown[0]!r} (it records {', '.join(fields)})", path=where)
    return {name: item for name, item in record.items() if item is not None}


def _check_mixture(data: Mapping[str, Any], where: str) -> None:
    """The recorded ``sources`` and ``subset``, field by field: what ``SourceSpec`` and ``Subset`` are then made
    from (they check how the fields combine)."""
    for index, value in enumerate(data.get("sources") or ()):
        what = f"sources[{index}]"
        source = _record(value, what, SOURCE_FIELDS, where)
        as_str(get(source, "path", what, where=where), f"{what}.path", where=where)
        for name in ("weight", "repeat"):
            if name in source and not as_number(source[name], f"{what}.{name}", where=where) > 0:
                raise ManifestError(f"{what}.{name} is {source[name]!r}: expected a number above 0", path=where)
        if "choose" in source:
            as_int(source["choose"], f"{what}.choose", lo=1, where=where)
    if data.get("subset") is None:
        return
    subset = _record(data["subset"], "subset", SUBSET_FIELDS, where)
    for index, name in enumerate(as_list(subset.get("classes", []), "subset.classes", where=where)):
        as_str(name, f"subset.classes[{index}]", where=where)
    for name in ("keys", "where"):
        if name in subset:
            as_str(subset[name], f"subset.{name}", where=where)
    if "max_samples" in subset:
        as_int(subset["max_samples"], "subset.max_samples", lo=1, where=where)


def config_shape(data: Any, where: str) -> dict[str, Any]:
    """``data`` if it is a run config as ``train-from-shards`` writes it: an object whose every ``TrainConfig``
    field holds a value of that field's type (``"7"``, ``2.5`` or ``true`` for epochs, ``NaN`` for a rate are
    refused, not converted), with recorded ``sources`` and ``subset`` checked field by field."""
    data = as_object(data, "the run config", where=where)
    for item in dataclasses.fields(TrainConfig):
        kind, _, optional = str(item.type).partition(" | ")
        required = item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING
        if item.name not in data and not required:
            continue
        value = get(data, item.name, "", where=where)
        if value is not None or not optional:
            _FIELD_SHAPES[kind](value, item.name, where=where)
    _check_mixture(data, where)
    return data


def plan_run(cfg: TrainConfig) -> RunPlan:
    """Decide, without writing, how this config may use ``cfg.out_dir``."""
    folder = Path(cfg.out_dir)
    if not folder.exists() or not any(folder.iterdir()):
        return RunPlan(folder, None)
    if cfg.overwrite:
        owned = RUN_FILES if is_run_folder(folder) else ()
        refuse_clobber(folder, owned, RUN_FILES, writer="train-from-shards")
        return RunPlan(folder, None, clear=owned)
    config_path = folder / CONFIG_FILE
    if not config_path.exists():
        raise OutputExistsError("is not empty and holds no training run; choose another --out or pass --overwrite",
                                path=str(folder))
    recorded = read_run_config(config_path, "; use --overwrite to replace the run")
    differences = recorded.differences(cfg)
    if cfg.mixed and recorded.exclude_keys != cfg.exclude_keys and not differences:
        # A mixture leaves keys out where it selects its runs, so its draw (and fingerprint) would change.
        raise OutputExistsError("holds a run of a mixture or subset: its --exclude-keys cannot change at a resume "
                                "(a single dataset's can); choose another --out or pass --overwrite",
                                path=str(folder))
    if differences:
        raise OutputExistsError(f"holds a different run (differs in {', '.join(differences)}); "
                                "choose another --out or pass --overwrite", path=str(folder))
    if not cfg.resume:
        raise OutputExistsError("holds a run of this config; pass --resume to continue it or --overwrite to "
                                "start again", path=str(folder))
    last = folder / LAST_FILE
    return RunPlan(folder, last if last.exists() else None)


def start_run(plan: RunPlan, cfg: TrainConfig, mixture: Mapping[str, Any] | None = None,
              scale: Mapping[str, Any] | None = None) -> None:
    """Rank 0 only: clear our own files when overwriting, then record the config (and a mixture's composition,
    which ``shards report`` shows; a resumed run reads back only the config's own fields) and the feature scale
    (``SCALE_FILE``; the checkpoints carry it too, as the model's buffers)."""
    plan.folder.mkdir(parents=True, exist_ok=True)
    if plan.clear:
        remove_owned(plan.folder, plan.clear)
    if scale is not None:
        write_json_atomic(plan.path(SCALE_FILE), dict(scale))
    record = cfg.to_dict()
    if mixture is not None:
        record["mixture"] = dict(mixture)
    write_json_atomic(plan.path(CONFIG_FILE), record)


def write_metrics(path: Path, history: Iterable[Mapping[str, Any]]) -> None:
    """Rewrite ``metrics.jsonl`` from the history (kept in the checkpoint), so a resume never duplicates lines."""
    text = "".join(json.dumps(row, sort_keys=True) + "\n" for row in history)
    with atomic_output(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s rows, read back through the door: every line a JSON object whose ``epoch`` is a positive
    integer (``shards.report.run.metrics_row_problem``, the report's rule too), else a ``ManifestError`` naming
    the file and the line."""
    where = str(path)
    try:
        text = read_regular_file(path, error=ManifestError).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=where) from None
    rows = []
    for number, row, why in json_lines(text):
        problem = f"is not JSON ({why})" if why is not None else metrics_row_problem(row)
        if problem is not None:
            raise ManifestError(f"line {number} {problem}", path=where)
        rows.append(row)
    return rows
