"""Checkpoints a resumed run can continue from exactly, readable with ``torch.load(weights_only=True)``.

A checkpoint holds only tensors and plain containers of numbers and strings: model, optimizer, scheduler and
scaler state dicts, the loader's position, epoch and step, the epoch's running sums, the metrics history, the
config, and every RNG state converted to tensors and lists (never pickled objects). Writes are atomic.

A checkpoint handed to ``--resume`` is untrusted input (docs/trust-model.md): it is opened as a regular file only,
``torch.load`` runs with ``weights_only=True`` inside the one parser guard, and the loader state in it is checked
field by field (``LoaderState.from_dict``) before anything is restored. A file holding pickled objects is refused in
one line that names what torch refused, without torch's advice to load it with ``weights_only=False`` (which would
run the file's code).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shards.atomic import atomic_output
from shards.door.bounded_read import load_weights_only, open_regular_file
from shards.errors import CorruptDataError, InputError, MissingInputError
from shards.position.resume import LoaderState
from shards.runrecord import BEST_FILE, LAST_FILE
from train.run.epoch import TrainState

CHECKPOINT_VERSION = 1
log = logging.getLogger("shardcache.train")


def capture_rng_state() -> dict[str, Any]:
    """torch (CPU and CUDA), numpy's global and Python's ``random`` states as tensors and lists."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "python": {"version": int(py_version), "internal": list(py_internal), "gauss_next": py_gauss},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    py_state = state["python"]
    random.setstate((py_state["version"], tuple(py_state["internal"]), py_state["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically (a unique temp file, fsync, rename)."""
    path = Path(path)
    with atomic_output(path) as tmp, open(tmp, "wb") as handle:
        # A file object, not the path: torch would name the archive inside after the unique temp name.
        torch.save({"checkpoint_version": CHECKPOINT_VERSION, **state}, handle)
    return path


def copy_checkpoint(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """``best.pt`` as an atomic copy of the ``last.pt`` just written (one serialisation per epoch)."""
    with atomic_output(target) as tmp:
        shutil.copyfile(source, tmp)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load with ``weights_only=True``: a checkpoint can never execute code. The loader state in it is checked
    here, so a tampered one is an ``InputError`` naming the file and the field before anything is restored."""
    where = str(path)
    if not Path(path).exists():
        raise MissingInputError("no checkpoint", path=where)
    with open_regular_file(path, error=CorruptDataError) as handle:
        state = load_weights_only(handle, where, "unreadable checkpoint")
    version = state.get("checkpoint_version") if isinstance(state, dict) else None
    if type(version) is not int or version != CHECKPOINT_VERSION:
        raise CorruptDataError(f"not a shardcache checkpoint of version {CHECKPOINT_VERSION}", path=where)
    if state.get("loader") is not None:
        try:
            LoaderState.from_dict(state["loader"])
        except InputError as exc:
            raise InputError(f"{exc.reason} (in the checkpoint's 'loader')", path=where) from None
    return state



class Checkpoints:
    """The run's ``last.pt`` and ``best.pt``: what goes in, when it is written, and putting it back at a resume."""

    def __init__(self, run: Any) -> None:
        self.run = run  # the loop's Run: its model, optimizer, scheduler, scaler, state and loaders

    def state(self, loader_state: dict[str, Any] | None) -> dict[str, Any]:
        run = self.run
        return {
            "model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
            "loader": loader_state, "train_state": run.state.to_dict(), "rng": capture_rng_state(),
            "config": run.cfg.to_dict(), "classes": list(run.data.classes),
            "data_identity": run.data.data_identity(),
        }

    def save_last(self, *, mid_epoch: bool) -> None:
        """``last.pt``: at an epoch end the loader state is None (the next epoch starts fresh)."""
        run = self.run
        loader_state = None
        if mid_epoch:
            # The batches this loop has trained on, not the ones a prefetcher has already drawn.
            loader_state = run.data.train_loader.state_dict(batches_consumed=run.state.batch_in_epoch)
        if run.ctx.is_main:
            save_checkpoint(run.plan.path(LAST_FILE), self.state(loader_state))

    def save_epoch(self, improved: bool) -> None:
        """Rank 0 at an epoch's end: ``last.pt``, and ``best.pt`` as its copy when the epoch is the best."""
        self.save_last(mid_epoch=False)
        if improved:
            copy_checkpoint(self.run.plan.path(LAST_FILE), self.run.plan.path(BEST_FILE))

    def restore(self, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
        """Put ``checkpoint`` back into the run; the loader state it held (None at an epoch's end)."""
        run = self.run
        saved, now = checkpoint.get("data_identity"), run.data.data_identity()  # None: a checkpoint from before
        if saved is not None and now is not None and saved != now:
            raise InputError(f"--resume: {run.plan.resume_from} was trained on other data than {run.cfg.data.path} "
                             "holds now (its features were recomputed or its shards repacked since); the resumed "
                             "run would train on a mixture of the two: start a new run (--overwrite)")
        run.model.load_state_dict(checkpoint["model"])
        run.optimizer.load_state_dict(checkpoint["optimizer"])
        run.scheduler.load_state_dict(checkpoint["scheduler"])
        run.scaler.load_state_dict(checkpoint["scaler"])
        run.state = TrainState.from_dict(checkpoint["train_state"])
        if checkpoint["loader"] is not None:
            # Rank 0 saved its loader position; it holds for every rank (each consumes an equal share).
            run.data.train_loader.set_epoch(run.state.epoch)
            run.data.train_loader.load_state_dict(checkpoint["loader"])
        restore_rng_state(checkpoint["rng"])
        log.info("resumed from %s at epoch %d, step %d", run.plan.resume_from, run.state.epoch + 1, run.state.step)
        return checkpoint["loader"]
