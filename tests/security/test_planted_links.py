"""An output folder in a shared place may hold a link someone planted where a run writes its own folders: the
pack's ``.pack``, the features' ``.precompute``, a column index's ``columns/<split>``. Each is made or used only as
a real folder (``shards.atomic.owned_folder``): a link is refused in one line naming it, and nothing is written
where it points."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from preprocess.features.featurize import FeatureConfig, run_precompute
from preprocess.pack.packer import PackConfig, pack_manifest
from shards.atomic import owned_folder
from shards.errors import InputError
from tests.helpers import make_shard_dataset, write_image_folder


def planted(out: Path, name: str, tmp_path: Path) -> Path:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir(parents=True, exist_ok=True)
    (out / name).symlink_to(elsewhere)
    return elsewhere


def test_a_planted_pack_state_folder_is_refused_and_nothing_lands_where_it_points(tmp_path):
    src = write_image_folder(tmp_path / "src", ["cat"], 2)
    elsewhere = planted(tmp_path / "out", ".pack", tmp_path)
    with pytest.raises(InputError, match="is a symbolic link; shardcache writes only real folders") as caught:
        pack_manifest(PackConfig(source=str(src), out=str(tmp_path / "out"), quiet=True))
    assert str(tmp_path / "out" / ".pack") in str(caught.value) and "\n" not in str(caught.value)
    assert list(elsewhere.iterdir()) == []


def test_a_planted_features_state_folder_is_refused(tmp_path):
    make_shard_dataset(tmp_path / "ds", shard_sizes={"train": [3]}, size=(16, 16))
    elsewhere = planted(tmp_path / "feats", ".precompute", tmp_path)
    with pytest.raises(InputError, match="is a symbolic link"):
        run_precompute(FeatureConfig(data_dir=tmp_path / "ds", out_dir=tmp_path / "feats", backbone="resnet18",
                                     resize=32, crop=32, batch_size=4, device="cpu", workers=0, quiet=True))
    assert list(elsewhere.iterdir()) == []


def test_owned_folders_are_made_level_by_level_and_never_through_a_link(tmp_path):
    out = tmp_path / "out"
    assert owned_folder(out, "columns/train") == out / "columns" / "train" and (out / "columns" / "train").is_dir()
    elsewhere = planted(out, "linked", tmp_path)
    for rel in ("linked", "linked/train"):
        with pytest.raises(InputError, match="is a symbolic link"):
            owned_folder(out, rel)
    (out / "file").write_text("x")
    with pytest.raises(InputError, match="is not a folder"):
        owned_folder(out, "file/x")
    with pytest.raises(InputError, match="leaves the output folder"):
        owned_folder(out, "columns/../..")
    assert list(elsewhere.iterdir()) == [] and os.path.islink(out / "linked")
