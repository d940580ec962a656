"""Mixtures and subsets over object storage: a local folder and an ``s3://`` prefix mixed, a subset of an S3 source
filtered by reading its candidate shards (no local source index), the same samples as the same mixture on disk."""

from __future__ import annotations

import collections

import pytest

import shards
from shards.select.mixture import MixOptions, SourceSpec, Subset
from tests.shards.test_mixture import write_images, zero

pytestmark = [pytest.mark.s3, pytest.mark.slow]  # slow: starting and stopping SeaweedFS takes seconds


def keys(dataset) -> list[str]:
    return [key for _, _, key in dataset]


def test_a_local_and_an_s3_source_mix_like_two_local_ones(bucket, tmp_path):
    write_images(tmp_path / "p", "p", [[0, 1, 2] * 2, [1, 2] * 3])
    write_images(tmp_path / "q", "q", [[2, 0] * 2, [1] * 4])
    remote_q = bucket.upload(tmp_path / "q", "q")
    options = dict(return_keys=True, seed=7, decode=shards.Decode(decoder=zero), mix=MixOptions(epoch_size=20))
    local = shards.open_dataset([SourceSpec(tmp_path / "p", weight=1), SourceSpec(tmp_path / "q", weight=1)],
                                "train", **options)
    mixed = shards.open_dataset([SourceSpec(tmp_path / "p", weight=1), SourceSpec(remote_q, weight=1)],
                                "train", **options)
    assert keys(mixed) == keys(local)
    assert collections.Counter(k[0] for k in keys(mixed)) == {"p": 10, "q": 10}


def test_a_subset_of_an_s3_source_reads_only_shards_that_may_match(bucket, tmp_path):
    write_images(tmp_path / "d", "d", [[0, 0, 0], [2, 2], [0, 2, 0, 2]])
    url = bucket.upload(tmp_path / "d", "d")
    subset = shards.open_dataset(shards.SourceSpec(url, subset=Subset(classes=["c"])), "train", return_keys=True,
                                 decode=shards.Decode(decoder=zero))
    assert sorted(keys(subset)) == ["d-00003", "d-00004", "d-00006", "d-00008"]
    assert [s.path for s in subset.split_info.shards] == ["train-000001.tar", "train-000002.tar"]
