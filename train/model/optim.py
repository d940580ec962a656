"""Optimizer and learning-rate schedule: SGD with momentum or AdamW, linear warmup then cosine decay per step.

The schedule is a ``LambdaLR`` over a plain function of the step, so its checkpoint is just the step count and a
resumed run recomputes the same rates from the config.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from train.config import TrainConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay weights only: decaying biases and norm scales hurts and is the usual mistake."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim > 1 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.optim.weight_decay)
    if cfg.optim.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.optim.resolved_lr, momentum=cfg.optim.momentum,
                               nesterov=cfg.optim.momentum > 0)
    return torch.optim.AdamW(groups, lr=cfg.optim.resolved_lr)


def warmup_cosine(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """Factor of the base rate at ``step``: linear ramp from 1/warmup to 1, then half a cosine down to 0."""
    total_steps = max(1, total_steps)
    warmup_steps = min(max(0, warmup_steps), total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer,
                    steps_per_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    total = cfg.optim.epochs * steps_per_epoch
    warmup = round(cfg.optim.warmup_epochs * steps_per_epoch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(total, warmup))
