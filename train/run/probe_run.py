"""The feature heads' extra steps in a run: standardising (any head) and the ``--head logreg`` fit.

``prepare_features`` runs before the run folder is touched: it refuses what cannot work (a probe or standardising
on image shards, a probe on a regression target, train features over the memory budget) and computes the train
split's ``FeatureScale``. ``fit_probe`` takes the place of the epochs for ``--head logreg``: it loads the train rows
once (float64, standardised), chooses ``C`` on a held-out part (``train.model.probe``), refits on all of them, puts the
weights into the run's model and then writes what every run writes (one ``metrics.jsonl`` row scored by the same
``evaluate`` as the other heads, ``last.pt``, ``best.pt``, ``model.pt``, the curves and the report).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from shards.errors import InputError
from shards.runrecord import METRICS_FILE, EpochRow, write_rows
from train.config import TrainConfig
from train.run.epoch import evaluate
from train.model.metrics import CONFUSION_IN_METRICS_MAX_CLASSES
from train.model.probe import (HELDOUT_SHARE, LogregFit, check_probe_memory, choose_c, fit_logreg, heldout_split,
                         top1_and_loss)
from train.model.regression import manifest_task
from train.model.standardize import FeatureScale, StandardizedHead, describe, feature_scale, row_blocks, train_rows

log = logging.getLogger("shardcache.train")


def prepare_features(cfg: TrainConfig, data: Any) -> FeatureScale | None:
    """Check what ``--head logreg`` and ``--standardize`` need; the train split's scale when standardising."""
    if cfg.model.head != "logreg" and not cfg.model.standardize:
        return None
    asked = "--head logreg" if cfg.model.head == "logreg" else "--standardize"
    if data.kind != "features":
        raise InputError(f"{asked} applies to cached features (features.json); image shards train a torchvision "
                         "model", path=cfg.data.path)
    dataset = data.train_loader.dataset
    if cfg.model.head == "logreg":
        if manifest_task(data.manifest) == "regression":
            raise InputError("--head logreg is a classifier; a regression target trains with --head linear or mlp",
                             path=cfg.data.path)
        from shards.cache.memory_budget import default_memory_limit

        rows = len(train_rows(dataset))
        if rows == 0:
            raise InputError("--head logreg: the train split selects no rows to fit", path=cfg.data.path)
        stored = torch.empty(0, dtype=getattr(torch, data.manifest.dtype, torch.float32)).element_size()
        budget = cfg.cache.memory_limit if cfg.cache.memory_limit is not None else default_memory_limit()
        check_probe_memory(rows, data.features_dim, len(data.classes), stored, budget, cfg.data.path)
    if not cfg.model.standardize:
        return None
    scale = feature_scale(dataset)
    log.info(describe(scale))
    return scale


def load_rows(dataset: Any, rows: np.ndarray, order: np.ndarray, scale: FeatureScale | None,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (float64, standardised with ``scale``) and labels of ``rows``, row ``rows[i]`` at ``order[i]``."""
    features = torch.empty(len(rows), dataset.features_dim, dtype=torch.float64, device=device)
    labels = torch.empty(len(rows), dtype=torch.int64, device=device)
    destination = torch.from_numpy(order)
    for positions, block, values in row_blocks(dataset, rows):
        where = destination[torch.from_numpy(positions)].to(device)
        features[where] = block.to(device, torch.float64)
        labels[where] = values.to(device, torch.int64)
    if scale is not None:
        features.sub_(scale.mean.to(device)).div_(scale.std.to(device))
    return features, labels


def split_order(dataset: Any, rows: np.ndarray, cfg: TrainConfig) -> tuple[int, int, np.ndarray]:
    """``(fit rows, held-out rows, order)``: where each of ``rows`` goes so the part ``C`` is fitted on comes first
    and the held-out part last (both then views of one table). No held-out part with a given ``--logreg-c``."""
    if cfg.model.logreg_c is not None:
        return len(rows), 0, np.arange(len(rows))
    # The held-out part is stratified: the labels are read first (the features stay unread).
    labels = np.concatenate([values.numpy() for _, _, values in row_blocks(dataset, rows, features=False)])
    fit_part, held = heldout_split(labels, HELDOUT_SHARE, cfg.optim.seed)
    order = np.empty(len(rows), dtype=np.int64)
    order[np.concatenate([fit_part, held]).astype(np.int64)] = np.arange(len(rows))
    return len(fit_part), len(held), order


def fit_probe(run: Any) -> dict[str, Any]:
    """Fit ``--head logreg`` as the run's one epoch; a resumed run that already has it only reports it."""
    cfg, data, ctx, state = run.cfg, run.data, run.ctx, run.state
    if state.history:  # killed after last.pt, perhaps before model.pt: write that again from the restored fit
        run.finish()
        return run.summary(state.history[-1], stopped=False)
    started = time.perf_counter()
    dataset = data.train_loader.dataset
    rows = train_rows(dataset)
    fit_rows, held_rows, order = split_order(dataset, rows, cfg)
    features, labels = load_rows(dataset, rows, order, run.scale, ctx.device)
    if not bool(torch.isfinite(features).all()):  # standardising refuses these earlier; --no-standardize here
        raise InputError("--head logreg: the train features hold a value that is not finite", path=cfg.data.path)
    loaded = time.perf_counter()
    c, start, table = cfg.model.logreg_c, None, []
    if c is None and held_rows == 0:
        c = 1.0
        log.warning("--head logreg: too few train rows to hold a part out; C = 1.0 (scikit-learn's default)")
    if c is None:
        c, start, table = choose_c(features, labels, fit_rows, len(data.classes))
    fit = fit_logreg(features, labels, len(data.classes), c, start=start)
    train_top1, train_loss = top1_and_loss(fit, features, labels)
    del features, labels
    fitted = time.perf_counter()
    set_weights(run.model, fit)
    val = evaluate(run.model, run.batches(data.val_loader), ctx.device, data.classes, False)
    probe = {"C": c, "chosen": "given" if cfg.model.logreg_c is not None else ("heldout" if table else "default"),
             "heldout_share": HELDOUT_SHARE if table else 0.0, "heldout_samples": held_rows if table else 0,
             "grid": table, "train_samples": int(len(rows)), "iterations": fit.iterations,
             "converged": fit.converged, "objective": fit.objective, "standardize": cfg.model.standardize,
             "load_s": loaded - started, "fit_s": fitted - loaded}
    row = EpochRow(**probe_row(probe, val, train_loss, train_top1, len(data.classes),
                               time.perf_counter() - started)).to_json()
    state.history.append(row)
    run.task.improved(state, row)
    state.epoch, state.step = 1, fit.iterations
    log_probe(row)
    if ctx.is_main:
        write_rows(run.plan.path(METRICS_FILE), run.history_rows())
        run.checkpoints.save_epoch(improved=True)  # the one fit is the best
    run.finish()
    ctx.barrier()
    return run.summary(row, stopped=False)


def probe_row(probe: dict[str, Any], val: dict[str, Any], train_loss: float, train_top1: float, classes: int,
              seconds: float) -> dict[str, Any]:
    """The fit's ``metrics.jsonl`` row, with an epoch's fields: the time loading features counts as the data wait,
    samples per second are train rows over the load and fit."""
    row = {"epoch": 1, "step": probe["iterations"], "train_loss": train_loss, "train_top1": train_top1,
           "samples_per_s": probe["train_samples"] / max(probe["load_s"] + probe["fit_s"], 1e-9),
           "data_wait_share": probe["load_s"] / seconds, "epoch_time_s": seconds, **val, "probe": probe}
    if classes > CONFUSION_IN_METRICS_MAX_CLASSES:
        row.pop("val_confusion")
    return row


def set_weights(model: torch.nn.Module, fit: LogregFit) -> None:
    """Put the fit into the run's linear layer (behind its ``Standardize``); under torchrun rank 0's fit is every
    rank's, so the ranks' shares of val are scored by one model."""
    layer = model.head if isinstance(model, StandardizedHead) else model
    with torch.no_grad():
        layer.weight.copy_(fit.weight)
        layer.bias.copy_(fit.bias)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            for tensor in (layer.weight, layer.bias):
                torch.distributed.broadcast(tensor, 0)


def log_probe(row: dict[str, Any]) -> None:
    """One line; a warning when L-BFGS stopped at its iteration limit (``probe.converged`` says so too)."""
    probe = row["probe"]
    how = {"given": "given", "default": "the default", "heldout": (
        f"chosen on a held-out {probe['heldout_share']:.0%} of train ({probe['heldout_samples']} rows)")}
    log.log(logging.INFO if probe["converged"] else logging.WARNING,
            "logreg: C = %g (%s), refit on %d train rows in %d L-BFGS iterations%s (%.1f s): train_top1 %.2f%%, "
            "val_top1 %.2f%%", probe["C"], how[probe["chosen"]], probe["train_samples"], probe["iterations"],
            "" if probe["converged"] else " (the limit: not converged)", row["epoch_time_s"],
            100 * row["train_top1"], 100 * row["val_top1"])
