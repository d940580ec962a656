"""What the run predicts: classes or a regression target, chosen once per run so the loop never asks again.

Each task knows its loss, how validation scores it, which epoch is the best (``best.pt``), the scores the log line
and the summary show, what of training's sums goes into the epoch row, and what ``model.pt`` needs to turn the
head's output back into a prediction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from train.config import TrainConfig
from train.model.regression import RegressionLoss, TargetScale
from train.run.epoch import evaluate_regression
from train.run.epoch import TrainState, evaluate


@dataclass
class Classification:
    loss_fn: nn.Module
    classes: list[str]
    scores: tuple[str, ...] = ("val_top1", "val_top5")  # what the summary shows
    always_scored: tuple[str, ...] = ("val_top1",)  # in the summary even before an epoch (top-5: 5 classes or more)

    @property
    def outputs(self) -> int:
        return len(self.classes)

    def evaluate(self, model: nn.Module, batches: Any, device: torch.device, amp: bool,
                 normalize: nn.Module | None) -> dict[str, Any]:
        return evaluate(model, batches, device, self.classes, amp, normalize)

    def train_fields(self, loss: float, correct: float, samples: float) -> dict[str, Any]:
        return {"train_loss": loss / samples, "train_top1": correct / samples}

    def improved(self, state: TrainState, row: dict[str, Any]) -> bool:
        """The highest val top-1 so far."""
        improved = row["val_top1"] > state.best_val_top1
        state.best_val_top1 = max(state.best_val_top1, row["val_top1"])
        return improved

    def describe(self, row: dict[str, Any]) -> str:
        top5 = f", val_top5 {row['val_top5']:.2%}" if row.get("val_top5") is not None else ""
        return f"val_top1 {row['val_top1']:.2%}{top5}"

    def best(self, state: TrainState) -> dict[str, Any]:
        return {"best_val_top1": state.best_val_top1 if state.history else None}

    def target(self) -> None:
        return None


@dataclass
class Regression:
    loss_fn: RegressionLoss
    column: str | None
    loss: str
    scores: tuple[str, ...] = ("val_r2", "val_mse", "val_mae")
    always_scored: tuple[str, ...] = ("val_r2", "val_mse", "val_mae")
    outputs: int = 1  # the standardised target

    def evaluate(self, model: nn.Module, batches: Any, device: torch.device, amp: bool,
                 normalize: nn.Module | None) -> dict[str, Any]:
        return evaluate_regression(model, batches, device, self.loss_fn, amp, normalize)

    def train_fields(self, loss: float, correct: float, samples: float) -> dict[str, Any]:
        return {"train_loss": loss / samples}  # nothing is counted as correct

    def improved(self, state: TrainState, row: dict[str, Any]) -> bool:
        """The lowest finite val_mse so far: a diverged epoch's NaN never wins."""
        mse = row["val_mse"]
        improved = math.isfinite(mse) and (state.best_val_mse is None or mse < state.best_val_mse)
        if improved:
            state.best_val_mse = mse
        return improved

    def describe(self, row: dict[str, Any]) -> str:
        r2 = "n/a" if row.get("val_r2") is None else f"{row['val_r2']:.4f}"
        return f"val_r2 {r2}, val_mse {row['val_mse']:.4g}, val_mae {row['val_mae']:.4g}"

    def best(self, state: TrainState) -> dict[str, Any]:
        return {"best_val_mse": state.best_val_mse}

    def target(self) -> dict[str, Any]:
        """What turns the head's output back into the target: the column, its train mean and std, the loss (the
        head predicts ``(y - mean) / std``)."""
        return {"column": self.column, **self.loss_fn.scale.to_dict(), "loss": self.loss}


def class_weights(counts: list[int]) -> torch.Tensor:
    """Inverse class frequency, normalised so a balanced dataset gets all ones; absent classes get zero."""
    total, present = sum(counts), sum(1 for c in counts if c > 0)
    return torch.tensor([total / (present * c) if c > 0 else 0.0 for c in counts], dtype=torch.float32)


def make_task(cfg: TrainConfig, data: Any, device: torch.device) -> Classification | Regression:
    """The run's task, from what its data yields (``RunData.task``)."""
    if data.task == "regression":
        config = data.manifest.config
        return Regression(RegressionLoss(TargetScale.from_config(config), cfg.optim.loss),
                          config["target"].get("column"), cfg.optim.loss)
    weighted = cfg.optim.class_weighted_loss
    weight = class_weights(data.train_class_counts(cfg.data.train_split)).to(device) if weighted else None
    return Classification(nn.CrossEntropyLoss(weight=weight, label_smoothing=cfg.optim.label_smoothing), data.classes)
