"""The demo's inputs: a seeded stratified split, and weights refused unless they are torchvision's exact file."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import demo_data  # noqa: E402


def _items(counts: dict[str, int]) -> list[tuple[Path, str]]:
    return [(Path(f"cell{name}{i:04d}.png"), name) for name, n in counts.items() for i in range(n)]


def test_split_is_stratified_seeded_and_disjoint():
    items = _items({"mono_p000": 50, "poly_p033": 10, "poly_p067": 3, "mono_p100": 1})
    split = demo_data.stratified_split(list(items), 0.2, seed=7)
    assert sorted(split["train"] + split["val"]) == sorted(items)
    val_counts = {name: sum(1 for _, c in split["val"] if c == name) for name in ("mono_p000", "poly_p033",
                                                                                   "poly_p067", "mono_p100")}
    assert val_counts == {"mono_p000": 10, "poly_p033": 2, "poly_p067": 1, "mono_p100": 0}
    assert demo_data.stratified_split(list(reversed(items)), 0.2, seed=7) == split
    assert demo_data.stratified_split(list(items), 0.2, seed=8)["val"] != split["val"]


def test_weights_with_another_checksum_are_refused(tmp_path):
    fake = tmp_path / demo_data.MOBILENET_V2_FILE
    fake.write_bytes(b"not the weights")
    with pytest.raises(demo_data.DemoInputError, match="is not torchvision's MobileNet_V2"):
        demo_data.verify_weights(fake)
    expected = hashlib.sha256(b"not the weights").hexdigest()
    assert demo_data.verify_weights(fake, sha256=expected) == expected


def test_the_pinned_checksum_matches_torchvisions_file_name():
    """torchvision names its weight files ``<arch>-<first 8 hex digits of the sha256>.pth``."""
    stem = Path(demo_data.MOBILENET_V2_FILE).stem
    assert stem.rsplit("-", 1)[1] == demo_data.MOBILENET_V2_SHA256[:8]
