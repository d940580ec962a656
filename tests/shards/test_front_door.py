"""The package's front door: what ``import shards`` offers a newcomer, and ``open_dataset``'s short signature.

The public list is pinned: a name added here is a promise to keep it, so it is added on purpose. Internals (the
dataset classes, the plan, decoders) are imported from their own modules.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

import shards
from shards.errors import InputError
from tests.helpers import make_shard_dataset

PUBLIC = ["open_dataset", "make_loader", "pad_collate", "WorkerProcesses", "InProcess", "Threads", "Auto", "StallPolicy",
          "Sampling", "ErrorPolicy", "Decode", "Remote", "ShardCache", "Distributed", "MemoryCache", "TransformSpec",
          "SourceSpec", "Subset", "MixOptions"]


def test_the_public_names_are_pinned_and_each_imports():
    assert sorted(shards.__all__) == sorted(PUBLIC)
    namespace: dict = {}
    exec("from shards import *", namespace)  # noqa: S102 - the star import a newcomer's notebook does
    for name in PUBLIC:
        assert namespace[name] is getattr(shards, name)
        module = importlib.import_module(namespace[name].__module__)
        assert getattr(module, name) is namespace[name]  # the same object its own module defines


@pytest.mark.parametrize("internal, home", [
    ("ShardDataset", "shards.stream.dataset"), ("ImageShardDataset", "shards.stream.image_dataset"),
    ("FeatureShardDataset", "shards.stream.feature_stream"), ("StreamConfig", "shards.stream.dataset"),
    ("plan_epoch", "shards.order.plan"), ("ImageDecoder", "shards.image.decode"),
    ("build_transform", "shards.image.transforms"), ("Normalize", "shards.image.fast"),
])
def test_internals_are_imported_from_their_modules_not_the_package(internal: str, home: str):
    with pytest.raises(AttributeError, match=internal):
        getattr(shards, internal)
    assert hasattr(importlib.import_module(home), internal)


def test_open_dataset_takes_at_most_twelve_parameters_and_the_common_case_is_one_line(tmp_path: Path):
    assert len(inspect.signature(shards.open_dataset).parameters) <= 12
    make_shard_dataset(tmp_path / "data", size=(20, 20))
    dataset = shards.open_dataset(tmp_path / "data", "train", transform="train")
    assert len(dataset) == 24


@pytest.mark.parametrize("keyword", ["shard_cache", "subset"])
def test_the_regrouped_keywords_are_gone(tmp_path: Path, keyword: str):
    make_shard_dataset(tmp_path / "data", size=(20, 20))
    with pytest.raises(TypeError, match=keyword):
        shards.open_dataset(tmp_path / "data", "train", **{keyword: None})


def test_the_node_cache_is_a_storage_tier_of_remote(tmp_path: Path):
    make_shard_dataset(tmp_path / "data", size=(20, 20))
    remote = shards.Remote(shard_cache=shards.ShardCache(tmp_path / "cache", local=True))
    dataset = shards.open_dataset(tmp_path / "data", "train", remote=remote)
    assert sum(1 for _ in dataset) == 24
    assert dataset.shard_cache.stats.snapshot()["misses"] == 4  # every shard copied to the node once
    assert list((tmp_path / "cache" / "v1").glob("??/*.tar"))
    with pytest.raises(InputError, match="Remote.shard_cache"):
        shards.Remote(shard_cache=str(tmp_path / "cache"))


def test_a_subset_belongs_to_its_source(tmp_path: Path):
    make_shard_dataset(tmp_path / "data", size=(20, 20))
    whole = shards.open_dataset(shards.SourceSpec(tmp_path / "data", subset=None), "train", return_keys=True,
                                sampling=shards.Sampling(shuffle=False))
    part = shards.open_dataset(shards.SourceSpec(tmp_path / "data", subset=shards.Subset(classes=["b"])), "train",
                               return_keys=True, sampling=shards.Sampling(shuffle=False))
    assert len(whole) == 24 and len(part) == 8
    assert {label for _, label, _ in part} == {1}
    with pytest.raises(InputError, match="must be a Subset"):
        shards.SourceSpec(tmp_path / "data", subset={"classes": ["b"]})
