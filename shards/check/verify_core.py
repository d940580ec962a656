"""What ``shards verify`` checks of a dataset's samples, kept apart from where the bytes come from
(``shards.check.verify`` reads them through the location layer): the report, the running tally, the check of one
shard's samples and of a split's totals, in the same words for every location.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shards.errors import CorruptDataError, InputError
from shards.formats.sample import label_problem
from shards.transport.storage import get_storage
from shards.image.decode import decode_image
from shards.manifest import ShardInfo

DEFAULT_SAMPLES_PER_SHARD = 4


@dataclass(frozen=True)
class VerifyReport:
    """What ``shards verify`` found in one dataset or feature folder (local or ``s3://``); ``ok`` when nothing."""

    folder: str
    kind: str  # "images" or "features"
    problems: tuple[str, ...]
    shards_checked: int = 0
    samples_read: int = 0
    samples_decoded: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"folder": self.folder, "kind": self.kind, "ok": self.ok, "problems": list(self.problems),
                "shards_checked": self.shards_checked, "samples_read": self.samples_read,
                "samples_decoded": self.samples_decoded}


@dataclass(frozen=True)
class VerifyOptions:
    """How to verify: decode every image (``full``) or ``samples_per_shard`` of each, in ``workers`` processes,
    with a progress bar of shards done on stderr unless ``quiet``."""

    full: bool = False
    samples_per_shard: int = DEFAULT_SAMPLES_PER_SHARD
    workers: int = 1
    quiet: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise InputError(f"workers must be a whole number of processes >= 1, got {self.workers!r}")


def decode_positions(count: int, wanted: int) -> set[int]:
    """Which samples to decode: evenly spread, always the first and last, the same on every run."""
    if wanted <= 0 or count <= 0:
        return set()
    if wanted >= count:
        return set(range(count))
    if wanted == 1:
        return {0}
    return {round(i * (count - 1) / (wanted - 1)) for i in range(wanted)}


@dataclass
class ShardTally:
    """What checking one shard found, on its own (so a worker process can check it and send it back): its problems
    in the order found, each tagged with how many of its keys had been read when it was found (where the dataset's
    duplicate-key check of the next key goes between them), its keys and labels in order (for the dataset-wide
    checks: keys unique, the column index agreeing), its in-range class counts and the samples read and
    decoded."""

    n_classes: int
    problems: list[tuple[int, str]] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    read: int = 0
    decoded: int = 0
    class_counts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.class_counts = [0] * self.n_classes

    def problem(self, text: str) -> None:
        self.problems.append((len(self.keys), text))


class Tally:
    """What a verification has found so far: problems, per-split class counts, keys seen and where, counts read
    and decoded (one per dataset; each shard's ``ShardTally`` is added in shard order)."""

    def __init__(self, n_classes: int):
        self.problems: list[str] = []
        self.class_counts: dict[str, list[int]] = {}
        self.keys: dict[str, str] = {}
        self.read = 0
        self.decoded = 0
        self.n_classes = n_classes

    def add(self, split: str, shard_path: str, shard: ShardTally) -> None:
        """Merge one shard's findings: its problems in the order found, each key checked against every key seen
        before it (this shard's earlier ones too) at the point the serial read would have."""
        problems = iter(shard.problems)
        pending = next(problems, None)
        for position, key in enumerate(shard.keys):
            while pending is not None and pending[0] <= position:
                self.problems.append(pending[1])
                pending = next(problems, None)
            if key in self.keys:
                self.problems.append(f"{shard_path} [sample {key}]: key also in {self.keys[key]}")
            self.keys[key] = shard_path
        while pending is not None:
            self.problems.append(pending[1])
            pending = next(problems, None)
        counts = self.class_counts.setdefault(split, [0] * self.n_classes)
        for label, count in enumerate(shard.class_counts):
            counts[label] += count
        self.read += shard.read
        self.decoded += shard.decoded


def check_samples(path: Path, storage: str, shard: ShardInfo, decode_wanted: int | None, tally: ShardTally, *,
                  offsets: Any = None) -> None:
    """Read the samples of one shard (the file at ``path``: the shard itself, or a copy of it): labels in range,
    the recorded sample and class counts, and the images at the ``decode_wanted`` spread positions (every one with
    ``None``) decode (``offsets``: an adopted tar's rows, which say where its samples are). Its keys and labels are
    kept in ``tally`` for the dataset-wide checks (``Tally.add``, the column index in ``shards.check.verify``)."""
    positions = None if decode_wanted is None else decode_positions(shard.samples, decode_wanted)
    seen, last_key = 0, None
    own = tally.class_counts  # this shard's, against its recorded class_counts (what subsets skip shards by)
    try:
        reader = get_storage(storage)
        samples = reader.read(path) if offsets is None else reader.read_slice(path, 0, None, offsets=offsets)
        for position, sample in enumerate(samples):
            seen, last_key = seen + 1, sample.key
            where = f"{shard.path} [sample {sample.key}]"
            tally.keys.append(sample.key)
            tally.labels.append(sample.label)
            # The range only: the shard's recorded class counts are compared whole below (one line, not one a sample).
            problem = label_problem(sample.label, tally.n_classes)
            if problem is not None:
                tally.problem(f"{where}: {problem}")
            if 0 <= sample.label < tally.n_classes:
                own[sample.label] += 1
            if positions is None or position in positions:
                try:
                    decode_image(sample.data)
                    tally.decoded += 1
                except Exception as exc:  # any decoder failure is corruption worth naming
                    tally.problem(f"{where}: image does not decode ({type(exc).__name__}: {exc})")
    except CorruptDataError as exc:
        where = shard.path if last_key is None else f"{shard.path} [after sample {last_key}]"
        tally.problem(f"{where}: unreadable after {seen} samples ({exc})")
    tally.read += seen
    if seen != shard.samples:
        tally.problem(f"{shard.path}: holds {seen} samples, manifest says {shard.samples}")
    elif shard.class_counts is not None and list(shard.class_counts) != own:
        tally.problem(f"{shard.path}: class counts {own} differ from the manifest's per-shard "
                      f"{list(shard.class_counts)}")


def check_split_totals(split_name: str, split: Any, tally: Tally) -> None:
    """The split's own totals against its shards and the labels read (class counts only when nothing else failed,
    so one damaged shard is not reported twice)."""
    if sum(s.samples for s in split.shards) != split.samples:
        tally.problems.append(f"split {split_name}: shard sample counts do not add up to {split.samples}")
    counted = tally.class_counts.get(split_name)
    if counted is not None and tuple(counted) != tuple(split.class_counts) and not tally.problems:
        tally.problems.append(f"split {split_name}: class counts {counted} differ from the manifest's "
                              f"{list(split.class_counts)}")
