"""``--overwrite`` replaces only what shardcache wrote: a ``dataset.json`` of the user's own (another tool's config,
no shardcache format) is refused with and without the flag, never replaced; one of ours that is damaged (it names
our format, the rest unreadable) is replaced. The refusal of a folder that cannot be compared says which flag."""

from __future__ import annotations

import json

import pytest

from preprocess.pack.packer import PackConfig, pack_manifest
from shards.errors import OutputExistsError
from shards.manifest import load_dataset_manifest
from tests.helpers import write_image_folder


def pack(src, out, **options):
    return pack_manifest(PackConfig(source=str(src), out=str(out), quiet=True, **options))


def test_a_users_own_dataset_json_is_never_replaced(tmp_path):
    src = write_image_folder(tmp_path / "src", ["cat", "dog"], 2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "dataset.json").write_text('{"my": "config"}')
    with pytest.raises(OutputExistsError, match="holds no shardcache dataset; pass --overwrite"):
        pack(src, out)
    with pytest.raises(OutputExistsError, match=r"did not write here but would replace \(dataset.json\)"):
        pack(src, out, overwrite=True)
    assert (out / "dataset.json").read_text() == '{"my": "config"}'
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["dataset.json"]


def test_a_damaged_dataset_json_of_ours_is_replaced_with_overwrite(tmp_path):
    src = write_image_folder(tmp_path / "src", ["cat", "dog"], 2)
    out = tmp_path / "out"
    pack(src, out)
    (out / "dataset.json").write_text(json.dumps({"format": "shardcache.dataset", "version": 1, "splits": "?"}))
    with pytest.raises(OutputExistsError, match="pass --overwrite to replace it"):
        pack(src, out)
    pack(src, out, overwrite=True)
    assert load_dataset_manifest(out).splits["train"].samples == 4
