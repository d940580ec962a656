"""The run's views: ``curves.png`` and ``report.html`` in the run folder, redrawn as epochs end (at most every
``VIEW_REFRESH_S`` seconds, and always at the end) so a run in progress can be judged from its folder.

Both are rendering of what the run recorded: the curves are drawn by ``shards.report.curves`` from the epoch rows,
the report by ``shards.report.build.write_run_report`` from the folder's files. Each is imported on first use, so
importing the training loop does not pay for matplotlib.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from shards.atomic import write_bytes_atomic
from shards.runrecord import CURVES_FILE

# Redraw curves.png and report.html after an epoch only when they are this old.
VIEW_REFRESH_S = 30.0
log = logging.getLogger("shardcache.train")


def plot_curves(history: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Written atomically: a dashboard or ``rsync`` reading the file mid-epoch sees the old figure or the new one."""
    from shards.report.curves import curves_bytes

    path = Path(path)
    write_bytes_atomic(path, curves_bytes(history, "png"))
    return path


class Views:
    """When the views were last drawn: from the start, so a run of short epochs draws them once at its end, a
    long one after every epoch."""

    def __init__(self, folder: Path, report: bool) -> None:
        self.folder, self.report = folder, report
        self._drawn_at = time.monotonic()

    def refresh(self, history: Sequence[Mapping[str, Any]], *, final: bool) -> None:
        """Drawing takes about a second: after short epochs at most every ``VIEW_REFRESH_S``, always when
        ``final``."""
        now = time.monotonic()
        if not final and now - self._drawn_at < VIEW_REFRESH_S:
            return
        self._drawn_at = now
        plot_curves(history, self.folder / CURVES_FILE)
        if not self.report:
            return
        from shards.report.build import write_run_report

        try:
            write_run_report(self.folder)
        except Exception as exc:  # noqa: BLE001 - a view must never stop the training it reports on
            log.warning("report.html not written: %s", exc)
