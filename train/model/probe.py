"""``--head logreg``: a full-batch L-BFGS multinomial logistic regression, parameterised as scikit-learn's.

A linear probe on cached features is how backbones are compared, and the reference is scikit-learn's
``LogisticRegression`` (lbfgs) on standardised features. SGD on mini-batches lands near its optimum but not on it
(the demo's linear head: val top-1 0.750 where the reference reaches 0.77), so this fits the same objective the
same way: every train row at once, float64, ``torch.optim.LBFGS`` with a strong-Wolfe line search from zero
weights, minimising ``mean cross-entropy + ||W||^2 / (2 C n)`` (the intercept is not penalised). That is
scikit-learn's ``C * sum(loss) + ||W||^2 / 2`` divided by ``C n``: the same minimiser, so a ``C`` means the same in
both. Two classes: scikit-learn fits one vector ``v``; the softmax's two rows end at ``w1 = -w0 = v / 2``, so the
penalty is doubled to make ``||v||^2`` carry the same weight.

``C`` is chosen on a held-out part of train (a seeded stratified ``HELDOUT_SHARE``) over ``C_GRID`` (scikit-learn's
``LogisticRegressionCV`` range, by decades, 1.0 included), by the lowest held-out cross-entropy (on one split of a
few hundred rows, top-1 moves by single samples, the loss does not), then refit on all of train with that ``C``.
The fit needs the train features in memory: ``probe_bytes`` estimates it and ``check_probe_memory`` refuses, before
anything is written, what does not fit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from shards.errors import InputError
from shards.units import human_bytes

log = logging.getLogger("shardcache.train")

C_GRID = tuple(10.0 ** k for k in range(-4, 5))
HELDOUT_SHARE = 0.2
MAX_ITER = 1000  # scikit-learn's LogisticRegression(max_iter=1000), the reference
HISTORY = 20  # L-BFGS correction pairs: 2 x HISTORY copies of the weights
TOLERANCE_GRAD = 1e-7  # on the mean objective; scikit-learn stops at 1e-4
TOLERANCE_CHANGE = 1e-12
ABSENT_LOGIT = -1e4  # a class with no train rows is never predicted (scikit-learn's model does not know it)


@dataclass(frozen=True)
class LogregFit:
    """Weights ``[K, D]`` and intercepts ``[K]`` (float64), the L-BFGS iterations, the objective at the end."""

    weight: torch.Tensor
    bias: torch.Tensor
    iterations: int
    objective: float
    converged: bool

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, features, self.weight.T)


def fit_logreg(features: torch.Tensor, labels: torch.Tensor, num_classes: int, c: float, *,
               start: LogregFit | None = None, max_iter: int = MAX_ITER) -> LogregFit:
    """Minimise ``mean CE + factor * ||W||^2 / (2 c n)`` over all rows (float64 on their device), from ``start``
    or zeros. Classes without rows are left out of the fit (their logit is ``ABSENT_LOGIT``)."""
    present = torch.unique(labels).tolist()
    index = torch.full((num_classes,), -1, dtype=torch.int64)
    index[present] = torch.arange(len(present))
    compact = index.to(labels.device)[labels]
    n, dim, k = features.shape[0], features.shape[1], len(present)
    factor = 2.0 if k == 2 else 1.0  # scikit-learn's binary model: one vector, see the module docstring
    device, dtype = features.device, torch.float64
    weight = torch.zeros(k, dim, dtype=dtype, device=device)
    bias = torch.zeros(k, dtype=dtype, device=device)
    if start is not None:
        weight.copy_(start.weight[present])
        bias.copy_(start.bias[present])
        bias -= bias.mean()  # the softmax ignores a shift; keep the intercepts centred as a start from zero does
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    strength = factor / (2.0 * c * n)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=max_iter, history_size=HISTORY,
                                  line_search_fn="strong_wolfe", tolerance_grad=TOLERANCE_GRAD,
                                  tolerance_change=TOLERANCE_CHANGE)

    def objective() -> torch.Tensor:
        return F.cross_entropy(torch.addmm(bias, features, weight.T), compact) + strength * weight.square().sum()

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = objective()
        loss.backward()
        return loss

    if k > 1:
        optimizer.step(closure)
    iterations = int(optimizer.state[weight].get("n_iter", 0)) if k > 1 else 0
    with torch.no_grad():
        final = float(objective()) if k > 1 else 0.0
    full_weight = torch.zeros(num_classes, dim, dtype=dtype, device=device)
    full_bias = torch.full((num_classes,), ABSENT_LOGIT, dtype=dtype, device=device)
    full_weight[present], full_bias[present] = weight.detach(), bias.detach()
    return LogregFit(full_weight, full_bias, iterations, final, iterations < max_iter)


def heldout_split(labels: np.ndarray, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(fit, held_out)`` positions: per class a seeded ``share`` held out (rounded), always leaving one to fit."""
    rng = np.random.default_rng([seed, 0x5C1E])  # its own stream: no other draw of the run moves it
    fit, held = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        count = min(int(round(len(members) * share)), len(members) - 1)
        held.append(members[:count])
        fit.append(members[count:])
    return np.sort(np.concatenate(fit)), np.sort(np.concatenate(held))


def top1_and_loss(fit: LogregFit, features: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    logits = fit.logits(features)
    return float((logits.argmax(dim=1) == labels).double().mean()), float(F.cross_entropy(logits, labels))


def choose_c(features: torch.Tensor, labels: torch.Tensor, fit_rows: int, num_classes: int,
             grid: Sequence[float] = C_GRID) -> tuple[float, LogregFit, list[dict[str, Any]]]:
    """Fit ``features[:fit_rows]`` for each ``C`` of ``grid`` (ascending, each from the last one's weights) and score
    the rest: ``(best C, its fit, the table)``; the best has the lowest held-out loss, then the highest top-1."""
    fit_x, fit_y = features[:fit_rows], labels[:fit_rows]
    held_x, held_y = features[fit_rows:], labels[fit_rows:]
    table, fits, last = [], [], None
    for c in sorted(grid):
        last = fit_logreg(fit_x, fit_y, num_classes, c, start=last)
        top1, loss = top1_and_loss(last, held_x, held_y)
        table.append({"C": c, "heldout_top1": top1, "heldout_loss": loss, "iterations": last.iterations})
        fits.append(last)
    best = min(range(len(table)), key=lambda i: (table[i]["heldout_loss"], -table[i]["heldout_top1"]))
    return table[best]["C"], fits[best], table


def probe_bytes(rows: int, dim: int, num_classes: int, stored_itemsize: int) -> int:
    """Memory the fit holds: the rows as float64 and as stored (the reader keeps small feature folders in memory),
    the logits and their gradient, and L-BFGS' history of the weights."""
    weights = (dim + 1) * num_classes * 8
    return rows * dim * (8 + stored_itemsize) + 4 * rows * num_classes * 8 + (2 * HISTORY + 8) * weights


def check_probe_memory(rows: int, dim: int, num_classes: int, stored_itemsize: int, budget: int,
                       where: str) -> int:
    """The estimate, or an ``InputError`` naming it when it is over ``budget`` bytes."""
    needed = probe_bytes(rows, dim, num_classes, stored_itemsize)
    if needed > budget:
        raise InputError(f"--head logreg holds the train features in memory: {rows} rows x {dim} dimensions need "
                         f"about {human_bytes(needed)}, over the budget of {human_bytes(budget)} (--memory-limit); "
                         "use --head linear, which streams them", path=where)
    return needed
