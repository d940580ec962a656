"""The training run's configuration: six option groups (``train.options``), validated on entry, saved into the run
folder.

Everything that changes the numbers lives here, so ``config.json`` and every checkpoint record how a run was made
and ``--resume`` can refuse to continue a run with different settings. Fields are named by their dotted path
(``loader.workers``) everywhere outside the groups: in ``config.json``, in ``differences`` and in
``RESUMABLE_CHANGES``. Each group checks its own fields; the rules that join two groups are checked here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from shards.errors import InputError
from train.config_file import read_groups
from train.options import CacheOptions, DataOptions, LoaderOptions, ModelOptions, OptimOptions, RunOptions

# Fields a resumed run may change without it being a different run: they steer the process, not the numbers
# (``optim.epochs`` extends a run; the schedule then follows the new length; other ``loader.workers`` continue the
# interrupted epoch with exactly the samples it had left, see shards.position.elastic; the run mode and its threads
# feed the same plan, so they resume each other's states; a cache's folder and sizes
# only decide what is kept where, except ``cache.images``, which changes the train views).
RESUMABLE_CHANGES = frozenset(
    {"optim.epochs", "data.exclude_keys", "data.source", "loader.workers", "loader.run_mode", "loader.worker_threads",
     "loader.stall_timeout", "loader.resume_audit", "loader.memory_budget", "cache.storage_options",
     "cache.dir", "cache.limit", "cache.fallback", "cache.local", "cache.eviction", "cache.prefetch_bytes",
     "cache.memory_limit", "run.device", "run.checkpoint_every", "run.resume", "run.overwrite", "run.dry_run",
     "run.quiet", "run.stop_after_steps", "run.report", "run.record_keys"}
)


@dataclass(frozen=True)
class TrainConfig:
    """How to train, by concern; ``TrainConfig.of(data_path, out_dir, {"optim.lr": 0.3})`` states only what it
    changes from the defaults."""

    data: DataOptions
    run: RunOptions
    model: ModelOptions = ModelOptions()
    optim: OptimOptions = OptimOptions()
    loader: LoaderOptions = LoaderOptions()
    cache: CacheOptions = CacheOptions()

    def __post_init__(self) -> None:
        for name, kind in GROUPS.items():
            given = getattr(self, name)
            if not isinstance(given, kind):
                raise InputError(f"TrainConfig.{name} is a {type(given).__name__}: expected {kind.__name__}")
        self._check_logreg()
        if self.cache.memory_limit is not None and not (self.cache.images or self.model.head == "logreg"):
            raise InputError(f"cache.memory_limit={self.cache.memory_limit!r} sizes the image cache (give "
                             "cache.images too) or the features of model.head='logreg'")
        if self.cache.images and self.loader.decode != "fast":
            raise InputError("cache.images needs loader.decode='fast' (its uint8 outputs are what is kept)")

    def _check_logreg(self) -> None:
        """The probe fits the plain cross-entropy of scikit-learn's model: options that change the loss are refused."""
        if self.model.head != "logreg":
            return
        optim = self.optim
        for name, used in (("class_weighted_loss", optim.class_weighted_loss),
                           ("balanced_sampler", optim.balanced_sampler), ("label_smoothing", optim.label_smoothing)):
            if used:
                raise InputError(f"optim.{name} does not apply to model.head='logreg', which fits scikit-learn's "
                                 "plain LogisticRegression objective")

    @classmethod
    def of(cls, data_path: str, out_dir: str, fields: Mapping[str, Any] | None = None) -> "TrainConfig":
        """A run of ``data_path`` into ``out_dir`` with the defaults, but for ``fields`` (dotted paths); each group is
        made once, so a default that follows another field (``model.standardize`` follows ``model.head``) does."""
        groups = _by_group(fields or {})
        groups.setdefault("data", {})["path"] = data_path
        groups.setdefault("run", {})["out_dir"] = out_dir
        return cls(**{group: GROUPS[group](**values) for group, values in groups.items()})

    def to_dict(self) -> dict[str, Any]:
        """The nested form ``config.json`` holds: one object per group."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "config.json") -> "TrainConfig":
        """A recorded config read back: an unknown group or field, or a value of the wrong type, is one
        ``ManifestError`` naming ``where`` and the field's path; then every group's and the joint checks."""
        return cls(**read_groups(data, GROUPS, where))

    def replace(self, fields: Mapping[str, Any]) -> "TrainConfig":
        """This config with ``fields`` (dotted paths: ``{"optim.lr": 0.3, "run.resume": True}``) changed; every
        check runs again on the result."""
        return dataclasses.replace(self, **{group: dataclasses.replace(getattr(self, group), **values)
                                            for group, values in _by_group(fields).items()})

    def differences(self, other: "TrainConfig") -> list[str]:
        """The dotted paths of the fields that make ``other`` a different run (ignoring what a resume may change)."""
        mine, theirs = _flat(self.to_dict()), _flat(other.to_dict())
        return sorted(k for k in mine if k not in RESUMABLE_CHANGES and mine[k] != theirs.get(k))


GROUPS: dict[str, type] = {"data": DataOptions, "model": ModelOptions, "optim": OptimOptions,
                           "loader": LoaderOptions, "cache": CacheOptions, "run": RunOptions}


def _by_group(fields: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"optim.lr": 0.3}`` as ``{"optim": {"lr": 0.3}}``; a path that names no field is refused."""
    groups: dict[str, dict[str, Any]] = {}
    for path, value in fields.items():
        group, _, name = path.partition(".")
        if group not in GROUPS or name not in {f.name for f in dataclasses.fields(GROUPS[group])}:
            raise InputError(f"{path!r} is not a TrainConfig field (give group.field, e.g. 'optim.lr')")
        groups.setdefault(group, {})[name] = value
    return groups


def _flat(config: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {f"{group}.{name}": value for group, fields in config.items() for name, value in fields.items()}
