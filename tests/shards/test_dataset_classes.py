"""``ds.classes`` and ``ds.class_to_idx`` as torchvision's ``ImageFolder`` has them, on every dataset
``open_dataset`` makes: image and feature folders, and mixtures, whose labels index the combined list."""

from __future__ import annotations

import pytest
import torch

import shards
from shards.loader.in_process import InProcess
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    base = tmp_path_factory.mktemp("classes")
    make_shard_dataset(base / "img", classes=("cat", "dog"), shard_sizes={"train": [4]}, size=(16, 16))
    write_feature_dataset(base / "feat_ab", [4], classes=("ant", "bee"))
    write_feature_dataset(base / "feat_bc", [3], classes=("bee", "cow"), first_row=100)
    return base


def test_image_and_feature_datasets_name_their_classes_as_imagefolder_does(root):
    images = shards.open_dataset(root / "img", "train")
    assert images.classes == ["cat", "dog"] and images.class_to_idx == {"cat": 0, "dog": 1}
    features = shards.open_dataset(root / "feat_ab", "train")
    assert features.classes == ["ant", "bee"] and features.class_to_idx == {"ant": 0, "bee": 1}


def test_a_mixture_names_the_combined_classes_its_labels_index(root):
    mixed = shards.open_dataset([root / "feat_ab", root / "feat_bc"], "train",
                                mix=shards.MixOptions(class_map="union"))
    assert mixed.classes == ["ant", "bee", "cow"] and mixed.class_to_idx == {"ant": 0, "bee": 1, "cow": 2}
    features, labels = (torch.cat(parts) for parts in zip(*shards.make_loader(mixed, 4, mode=InProcess(),
                                                                              drop_last=False)))
    for row, label in zip(features[:, 0].tolist(), labels.tolist()):
        own = ("ant", "bee") if row < 100 else ("bee", "cow")  # first_row tells the sources apart
        assert mixed.classes[label] == own[int(row) % 2 if row < 100 else int(row - 100) % 2]
