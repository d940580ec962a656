"""The run folder: what it holds, and whether a new run may start in it, continue it, or must refuse.

``RUN_DIR`` holds ``config.json``, ``metrics.jsonl``, ``curves.png``, ``last.pt``, ``best.pt``, ``model.pt``. A folder
that holds a different run, or anything that is not a run, is never touched without ``--overwrite``, which then
removes only the files of the run it replaces (none in a folder that holds no run) and refuses to write over a
file with one of a run's names that no run there wrote (``shards.owned``). The same decision is computed on every
rank (read-only), so an error stops all ranks alike instead of leaving some waiting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from shards.atomic import atomic_output, write_json_atomic
from shards.bounded_read import read_json_file
from shards.data_events import EVENTS_FILE  # layouts, exclusions, quarantines, restarts
from shards.errors import ManifestError, OutputExistsError
from shards.owned import refuse_clobber, remove_owned
from shards.report.run import is_run_folder
from train.config import TrainConfig

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
LAST_FILE = "last.pt"
BEST_FILE = "best.pt"
MODEL_FILE = "model.pt"
REPORT_FILE = "report.html"  # shards.report.build.write_run_report, redrawn as epochs end (at most every 30 s) and at the end
KEYS_FILE = "keys.jsonl"  # --record-keys (train.lineage)
SCALE_FILE = "feature-scale.json"  # the train split's feature mean and std, when standardising (train.standardize)
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


def _read_config(path: Path) -> TrainConfig:
    try:
        return TrainConfig.from_dict(read_json_file(path))
    except (ValueError, TypeError) as exc:
        raise ManifestError(f"not a readable run config ({getattr(exc, 'reason', exc)}); use --overwrite to replace "
                            "the run", path=str(path)) from exc


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
    recorded = _read_config(config_path)
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
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]
