"""Regression on a table's float targets: which task a run trains for, the loss on standardised targets, val metrics.

``pack-shards --table`` records the train split's target mean and std in ``features.json``'s ``config.target``.
Training against ``(y - mean) / std`` keeps the default learning rates sensible whatever the target's units, and
the same numbers travel into ``model.pt``, so a prediction is un-scaled exactly as during validation. The metrics
are float64 sums (as ``train.model.metrics`` keeps for classification), so ranks add them up before anything is divided;
``val_mse`` and ``val_mae`` are in the target's own units and ``val_r2`` is scikit-learn's ``r2_score``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shards.errors import InputError
from shards.formats.feature_names import target_task
from shards.manifest import DatasetManifest, FeatureManifest
from train.config import TrainConfig

HUBER_DELTA = 1.0  # in standardised units: errors beyond one train-split std count linearly


def manifest_task(manifest: DatasetManifest | FeatureManifest) -> str:
    """The task the data's rows are labelled for: regression for a feature folder of float targets."""
    return target_task(manifest.config) if isinstance(manifest, FeatureManifest) else "classification"


def resolve_task(cfg: TrainConfig, manifest: DatasetManifest | FeatureManifest) -> str:
    """The task ``cfg`` trains for (``auto``: the manifest's), refusing options that do not fit it.

    Checked before anything is built or written: a wrong combination is an input error with a one-line reason.
    """
    found = manifest_task(manifest)
    task = found if cfg.model.task == "auto" else cfg.model.task
    if task == "classification":
        if found == "regression":
            raise InputError("--task classification: features.json holds a regression target (config.target), "
                             "whose rows have no classes; use --task regression or auto", path=cfg.data.path)
        if cfg.optim.loss != "mse":
            raise InputError(f"--loss {cfg.optim.loss} applies to regression; classification trains with cross-entropy")
        return task
    if found != "regression":
        raise InputError("--task regression needs features with a float target: pack the table with pack-shards "
                         "--table --target COLUMN (--task regression), which records it in config.target",
                         path=cfg.data.path)
    for flag, used in (("--class-weighted-loss", cfg.optim.class_weighted_loss),
                       ("--balanced-sampler", cfg.optim.balanced_sampler),
                       ("--label-smoothing", cfg.optim.label_smoothing > 0)):
        if used:
            raise InputError(f"{flag} needs classes; a regression target has none")
    std = float(manifest.config["target"].get("std", 0.0))
    if not (math.isfinite(std) and std > 0):
        raise InputError(f"the target's train-split std is {std}: a constant target leaves nothing to learn",
                         path=cfg.data.path)
    return task


@dataclass(frozen=True)
class TargetScale:
    """The train split's target mean and std: targets are trained on as ``(y - mean) / std``."""

    mean: float
    std: float

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "TargetScale":
        target = config["target"]
        return cls(float(target["mean"]), float(target["std"]))

    def standardise(self, values: torch.Tensor) -> torch.Tensor:
        return (values - self.mean) / self.std

    def unscale(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs * self.std + self.mean

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "std": self.std}


class RegressionLoss(nn.Module):
    """The head's single output against the standardised target, with MSE or Huber."""

    def __init__(self, scale: TargetScale, loss: str = "mse"):
        super().__init__()
        self.scale = scale
        self.loss = loss

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        predicted, wanted = outputs.reshape(-1), self.scale.standardise(targets.float())
        if self.loss == "huber":
            return F.huber_loss(predicted, wanted, reduction=reduction, delta=HUBER_DELTA)
        return F.mse_loss(predicted, wanted, reduction=reduction)


class RegressionTally:
    """Running float64 sums over batches: loss, samples, squared and absolute errors in target units, and the
    standardised targets' sum and sum of squares (the total variance R² divides by, without cancellation)."""

    def __init__(self, scale: TargetScale, device: torch.device | str = "cpu"):
        self.scale = scale
        self.sums = torch.zeros(6, dtype=torch.float64, device=device)

    @torch.no_grad()
    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: torch.Tensor) -> None:
        """Add one batch: the head's outputs (standardised units), the targets (target units), the summed loss."""
        wanted = targets.double()
        errors = self.scale.unscale(outputs.reshape(-1).double()) - wanted
        standard = self.scale.standardise(wanted)
        count = torch.tensor(float(len(wanted)), dtype=torch.float64, device=self.sums.device)
        self.sums += torch.stack([loss_sum.detach().double(), count, errors.square().sum(), errors.abs().sum(),
                                  standard.sum(), standard.square().sum()])

    def all_reduce(self) -> None:
        """Sum across ranks (no-op without a process group)."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.sums)

    def result(self, prefix: str = "val_") -> dict[str, Any]:
        """Loss, MSE, MAE and R² (None with under two samples or a constant target: nothing to explain)."""
        loss_sum, samples, squared, absolute, standard_sum, standard_squares = self.sums.cpu().tolist()
        n = max(samples, 1.0)
        total = (standard_squares - standard_sum ** 2 / n) * self.scale.std ** 2
        return {f"{prefix}loss": loss_sum / n, f"{prefix}mse": squared / n, f"{prefix}mae": absolute / n,
                f"{prefix}r2": 1.0 - squared / total if total > 0 else None, f"{prefix}samples": int(samples)}
