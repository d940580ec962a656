"""``curves.png`` in a run folder, redrawn as epochs end (at most every 30 s, and at the end) so a run in progress can be judged from its folder.

The drawing lives in ``shards.report.curves``; it is imported on the first call, so importing the training loop does
not pay for matplotlib.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from shards.atomic import write_bytes_atomic


def plot_curves(history: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """Written atomically: a dashboard or ``rsync`` reading the file mid-epoch sees the old figure or the new one."""
    from shards.report.curves import curves_bytes

    path = Path(path)
    write_bytes_atomic(path, curves_bytes(history, "png"))
    return path
