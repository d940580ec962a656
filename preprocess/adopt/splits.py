"""Which split an adopted tar belongs to: named in a list, or drawn by a seeded fraction of shards.

The draw is per shard, from ``sha256(seed, relative name)``, not a permutation of the shards seen: a tar keeps its
split when later runs add tars (``shards index`` on a growing source), so an incremental index never moves a
sample between splits, and the same source and seed give the same splits on any machine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shards.errors import InputError


@dataclass(frozen=True)
class SplitRule:
    """``val_shards``/``train_shards``: relative tar names (``--val-shards``, ``--train-shards``); with only one list
    the other split holds the rest, with both every tar must be named. Otherwise ``val_fraction`` of the tars (by a
    draw from ``seed``) go to ``val``, the rest to ``train``."""

    val_fraction: float = 0.0
    seed: int = 0
    train_shards: tuple[str, ...] = ()
    val_shards: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)) \
                or not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"--val-fraction={self.val_fraction!r} must be a number in [0, 1)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InputError(f"--seed={self.seed!r} must be an integer")
        object.__setattr__(self, "train_shards", tuple(self.train_shards))
        object.__setattr__(self, "val_shards", tuple(self.val_shards))
        if (self.train_shards or self.val_shards) and self.val_fraction:
            raise InputError("give --val-fraction or shard lists (--train-shards/--val-shards), not both")
        both = set(self.train_shards) & set(self.val_shards)
        if both:
            raise InputError(f"{sorted(both)[0]!r} is named in both --train-shards and --val-shards")

    def split_of(self, rel: str) -> str:
        if self.val_shards or self.train_shards:
            if rel in self.val_shards:
                return "val"
            if rel in self.train_shards or not self.train_shards:
                return "train"
            if not self.val_shards:
                return "val"
            raise InputError("is in neither --train-shards nor --val-shards", path=rel)
        if not self.val_fraction:
            return "train"
        draw = int.from_bytes(hashlib.sha256(f"{self.seed}\0{rel}".encode()).digest()[:8], "big") / 2.0 ** 64
        return "val" if draw < self.val_fraction else "train"

    def to_dict(self) -> dict:
        return {"val_fraction": self.val_fraction, "seed": self.seed, "train_shards": list(self.train_shards),
                "val_shards": list(self.val_shards)}
