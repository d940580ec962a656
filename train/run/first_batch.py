"""Time to first batch: how long a run start (or a resume) took to hand the training loop its first batch, and
where that time went (``docs/training.md``, "Time to first batch").

The numbers are wall seconds of ``time.perf_counter`` in the training process, measured once per process:

- ``first_batch_s``: from the clock's origin (``train-from-shards``: the command's entry, after option parsing and
  before the training code and torch are imported; ``train(cfg)`` called from Python: that call) to the moment the
  loop holds its first batch;
- ``open_s``: the two ``open_dataset`` calls (train and val);
- ``plan_s`` and ``first_read_s`` split the loop's wait for that batch (from ``iter(loader)`` to the batch). The
  main process cannot see inside DataLoader workers, only their stage seconds (``shards.procs.stage_times``),
  so ``first_read_s`` is the worker seconds (read, decode, transform, collate) recorded by then divided by the
  number of workers (they start together and make their first batches side by side; an estimate, capped at the
  wait), and ``plan_s`` is the rest of the wait: starting workers, each worker's epoch order and covering reads,
  handing the batch over. Without workers the division is by one and the split is measured (the feature
  loader counts its epoch order as read, and so do batches a prefetch thread gathered ahead, up to the wait);
- ``other_s``: the rest of ``first_batch_s`` (imports, manifest checks, model, optimizer, a checkpoint's restore).

So ``open_s + plan_s + first_read_s + other_s == first_batch_s``.
"""

from __future__ import annotations

from typing import Any, Mapping

PARTS = ("open_s", "plan_s", "first_read_s", "other_s")


def first_batch_record(*, started: float, arrived: float, open_s: float, wait_s: float,
                       worker_seconds: Mapping[str, float], workers: int, resume: bool, epoch: int,
                       step: int) -> dict[str, Any]:
    """The record ``metrics.jsonl`` keeps of one start: ``started`` and ``arrived`` are ``perf_counter`` values (the
    clock's origin, the first batch), ``wait_s`` the loop's wait for that batch, ``worker_seconds`` the loader's
    worker-stage seconds from ``iter(loader)`` to the batch, ``workers`` its DataLoader workers (0: in-process)."""
    total = max(0.0, arrived - started)
    wait = max(0.0, wait_s)
    first_read = min(wait, sum(worker_seconds.values()) / max(1, workers))
    plan = wait - first_read
    open_s = max(0.0, open_s)
    return {"resume": resume, "epoch": epoch, "step": step, "first_batch_s": total, "open_s": open_s,
            "plan_s": plan, "first_read_s": first_read, "other_s": max(0.0, total - open_s - plan - first_read),
            "workers": workers}


def describe(record: Mapping[str, Any]) -> str:
    """The progress line's one sentence: ``first batch after 1.23 s (open 0.40, plan 0.10, first read 0.70)``."""
    after = "resume" if record["resume"] else "start"
    return (f"first batch {record['first_batch_s']:.2f} s after {after} (open {record['open_s']:.2f}, "
            f"plan {record['plan_s']:.2f}, first read {record['first_read_s']:.2f}, other {record['other_s']:.2f})")
