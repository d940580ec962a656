"""The run folder: whether a new run may start in it, continue it, or must refuse; and its config read back.

What a run folder holds is the run record's (``shards.runrecord``: the file names, ``run.json``, the epoch rows); this
module decides what a start may do with a folder. A folder that holds a different run, or anything that is not a
run, is never touched without ``--overwrite``, which then removes only the files of the run it replaces (none in a
folder that holds no run) and refuses to write over a file with one of a run's names that no run there wrote
(``shards.jobs.owned``). The same decision is computed on every rank (read-only), so an error stops all ranks alike
instead of leaving some waiting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from shards.atomic import make_output_folder, write_json_atomic
from shards.door.bounded_read import read_json_file
from shards.errors import ManifestError, OutputExistsError
from shards.jobs.owned import refuse_clobber, remove_owned
from shards.runrecord import CONFIG_FILE, LAST_FILE, RUN_FILES, SCALE_FILE, RunRecord, is_run_folder
from shards.door.shape import as_object
from train.config import TrainConfig

MIXTURE = "mixture"  # config.json's record of a mixture's composition, for shards report; not an option


@dataclass(frozen=True)
class RunPlan:
    """What to do with the folder: start fresh (clearing the replaced run's files when overwriting) or resume."""

    folder: Path
    resume_from: Path | None
    clear: tuple[str, ...] = ()  # the files of the run that --overwrite replaces

    def path(self, name: str) -> Path:
        return self.folder / name


def read_run_config(path: Path, advice: str = "") -> TrainConfig:
    """A run's ``config.json``, read back from an untrusted folder (a resume): its groups and fields shaped as
    ``TrainConfig`` declares them (``TrainConfig.from_dict``), the mixture record ``start_run`` adds beside them set
    aside, then the groups' own checks; any failure is one ``ManifestError`` naming the file and the field
    (``advice`` ends its message)."""
    try:
        recorded = dict(as_object(read_json_file(path), "the run config", where=str(path)))
        recorded.pop(MIXTURE, None)
        return TrainConfig.from_dict(recorded, where=str(path))
    except (ValueError, TypeError) as exc:  # a ManifestError is a ValueError: its reason is kept
        raise ManifestError(f"not a readable run config ({getattr(exc, 'reason', exc)}){advice}",
                            path=str(path)) from exc


def plan_run(cfg: TrainConfig) -> RunPlan:
    """Decide, without writing, how this config may use ``cfg.run.out_dir``."""
    folder = Path(cfg.run.out_dir)
    if not folder.exists() or not any(folder.iterdir()):
        return RunPlan(folder, None)
    if cfg.run.overwrite:
        owned = RUN_FILES if is_run_folder(folder) else ()
        refuse_clobber(folder, owned, RUN_FILES, writer="train-from-shards")
        return RunPlan(folder, None, clear=owned)
    config_path = folder / CONFIG_FILE
    if not config_path.exists():
        raise OutputExistsError("is not empty and holds no training run; choose another --out or pass --overwrite",
                                path=str(folder))
    recorded = read_run_config(config_path, "; use --overwrite to replace the run")
    differences = recorded.differences(cfg)
    if cfg.data.mixed and recorded.data.exclude_keys != cfg.data.exclude_keys and not differences:
        # A mixture leaves keys out where it selects its runs, so its draw (and fingerprint) would change.
        raise OutputExistsError("holds a run of a mixture or subset: its --exclude-keys cannot change at a resume "
                                "(a single dataset's can); choose another --out or pass --overwrite",
                                path=str(folder))
    if differences:
        raise OutputExistsError(f"holds a different run (differs in {', '.join(differences)}); "
                                "choose another --out or pass --overwrite", path=str(folder))
    if not cfg.run.resume:
        raise OutputExistsError("holds a run of this config; pass --resume to continue it or --overwrite to "
                                "start again", path=str(folder))
    last = folder / LAST_FILE
    return RunPlan(folder, last if last.exists() else None)


def start_run(plan: RunPlan, cfg: TrainConfig, mixture: Mapping[str, Any] | None = None,
              scale: Mapping[str, Any] | None = None, record: RunRecord | None = None) -> None:
    """Rank 0 only: clear our own files when overwriting, then record the config (and a mixture's composition,
    which ``shards report`` shows; a resumed run reads back only the config's own fields), the run record (the data
    calls this start made, for ``shards lineage``) and the feature scale (``SCALE_FILE``; the checkpoints carry it
    too, as the model's buffers)."""
    make_output_folder(plan.folder)
    if plan.clear:
        remove_owned(plan.folder, plan.clear)
    if scale is not None:
        write_json_atomic(plan.path(SCALE_FILE), dict(scale))
    config = cfg.to_dict()
    if mixture is not None:
        config[MIXTURE] = dict(mixture)
    write_json_atomic(plan.path(CONFIG_FILE), config)
    if record is not None:
        record.write(plan.folder)
