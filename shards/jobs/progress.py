"""Logs and progress bars: both on stderr, so stdout stays free for the JSON result."""

from __future__ import annotations

import logging
import sys
from typing import Iterable, TypeVar

from tqdm import tqdm

T = TypeVar("T")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(quiet: bool = False, verbose: bool = False) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose else logging.INFO)
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str = "",
             unit: str = "it", quiet: bool = False, unit_scale: bool = False, **kwargs) -> tqdm:
    """A tqdm bar on stderr with rates; ``quiet`` disables it entirely."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=quiet, file=sys.stderr,
                unit_scale=unit_scale, dynamic_ncols=True, mininterval=0.5, **kwargs)
