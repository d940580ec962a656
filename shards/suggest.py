"""``did you mean``: the close matches of a mistyped name, for error lines that would otherwise list every name.

A torchvision model list has 80-odd names; a line naming the two nearest is one a user reads.
"""

from __future__ import annotations

import difflib
from typing import Iterable


def did_you_mean(name: str, known: Iterable[str], *, more: str = "") -> str:
    """``"; did you mean 'resnet50'?"`` for the closest names (up to three), or ``more`` when none is close."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    if not close:
        return more
    return "; did you mean " + " or ".join(repr(n) for n in close) + "?"
