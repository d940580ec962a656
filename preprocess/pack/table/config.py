"""The options of ``pack-shards --table`` (``TableConfig``), checked on entry.

Kept in a module of its own, below the table reader (``preprocess.pack.table.read``), the encoding
(``preprocess.pack.table.encoding``) and the orchestration (``preprocess.pack.table.pack``), since all three read it
and the orchestration imports the other two.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from shards.atomic import check_local_output
from shards.errors import InputError

TASKS = ("auto", "classification", "regression")
ENCODINGS = ("onehot", "codes")
IMPUTE_STATISTICS = ("mean", "median", "zero")
TABLE_STORAGES = ("pt", "hdf5")


@dataclass(frozen=True)
class TableConfig:
    """Every option of ``pack-shards --table``; all but ``out`` and ``overwrite`` shape the output."""

    source: str
    out: str
    target: str
    columns: tuple[str, ...] | None = None  # None: every column but the target and the split column
    categorical: tuple[str, ...] = ()
    encode: str = "onehot"
    impute: str | None = None
    task: str = "auto"
    val_fraction: float | None = None  # None: DEFAULT_VAL_FRACTION, or none when the table has a split column
    seed: int = 0
    shuffle: bool = True
    max_samples: int = 1000
    storage: str = "pt"
    overwrite: bool = False

    def __post_init__(self) -> None:
        check_local_output(self.out)
        if not self.target:
            raise InputError("--table needs --target COLUMN (the column to predict)")
        for name, value, allowed in (("task", self.task, TASKS), ("encode", self.encode, ENCODINGS),
                                     ("storage", self.storage, TABLE_STORAGES),
                                     ("impute", self.impute, (None, *IMPUTE_STATISTICS))):
            if value not in allowed:
                raise InputError(f"{name}={value!r}: choose one of {', '.join(map(str, allowed))}")
        if self.max_samples < 1:
            raise InputError(f"max_samples={self.max_samples}: must be at least 1")
        if self.val_fraction is not None and not 0.0 <= self.val_fraction < 1.0:
            raise InputError(f"val_fraction={self.val_fraction}: must be in [0, 1)")
        for name in ("columns", "categorical"):
            names = getattr(self, name) or ()
            twice = sorted(c for c, n in Counter(names).items() if n > 1)
            if twice:
                raise InputError(f"--{name} names {twice[0]!r} twice")
