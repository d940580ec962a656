"""Feature shards: per-sample and in-process batched streaming with the image reader's guarantees."""

import collections

import pytest
import torch

import shards
from shards.loader.in_process import InProcess
from shards.stream.feature_stream import FeatureShardDataset
from shards.loader.worker_processes import WorkerProcesses
from tests.shards.stream_helpers import write_feature_dataset

SIZES = [10, 3, 7, 5]


@pytest.fixture(scope="module", params=["pt", "hdf5"])
def folder(tmp_path_factory, request):
    out = tmp_path_factory.mktemp(f"features_{request.param}")
    write_feature_dataset(out, SIZES, storage=request.param)
    return out


def rows_of(batches):
    return [int(row) for features, _ in batches for row in features[:, 0].tolist()]


def test_open_dataset_reads_features_json(folder):
    dataset = shards.open_dataset(folder, return_keys=True, sampling=shards.Sampling(shuffle=False))
    assert isinstance(dataset, FeatureShardDataset) and len(dataset) == 25
    items = list(dataset)
    assert [key for _, _, key in items] == [f"f{i:05d}" for i in range(25)]
    assert items[4][0].shape == (4,) and items[4][1] == 4 % 3


def test_batches_in_process_cover_the_epoch(folder):
    loader = shards.make_loader(shards.open_dataset(folder, seed=1), batch_size=4, drop_last=False)
    assert loader.mode == InProcess()  # the default for features
    batches = list(loader)
    assert len(batches) == len(loader) == 7
    assert batches[0][0].shape == (4, 4) and batches[0][0].dtype == torch.float16
    rows = rows_of(batches)
    assert sorted(rows) == list(range(25)) and rows != list(range(25))
    labels = torch.cat([labels for _, labels in batches])
    assert labels.tolist() == [row % 3 for row in rows]


def test_memory_and_mmap_give_the_same_batches(folder):
    def run(cache):
        loader = shards.make_loader(shards.open_dataset(folder, seed=2, cache=cache, return_keys=True), batch_size=6)
        loader.set_epoch(3)
        return [(f, l, k) for f, l, k in loader]
    memory, mapped = run("memory"), run("none")
    assert all(torch.equal(a[0], b[0]) and a[2] == b[2] for a, b in zip(memory, mapped))
    assert all(int(f[i, 0]) == int(k[i][1:]) for f, _, k in memory for i in range(len(k)))


def test_ranks_get_equal_disjoint_shares(folder):
    rows = []
    for rank in range(3):
        dataset = shards.open_dataset(folder, distributed=shards.Distributed(rank=rank, world_size=3))
        loader = shards.make_loader(dataset, batch_size=100, drop_last=False)
        rows.append(rows_of(loader))
    assert [len(r) for r in rows] == [9, 9, 9]
    tally = collections.Counter(x for r in rows for x in r)
    assert set(tally) == set(range(25)) and sum(tally.values()) == 27


def test_batched_resume(folder):
    def build():
        balanced = shards.Sampling(class_weights="balanced")
        return shards.make_loader(shards.open_dataset(folder, seed=5, sampling=balanced), batch_size=3)
    full = rows_of(build())
    first = build()
    iterator = iter(first)
    head = rows_of([next(iterator) for _ in range(3)])
    state = first.state_dict()
    resumed = build()
    resumed.load_state_dict(state)
    assert head + rows_of(resumed) == full


def test_per_sample_dataloader_path_with_workers(folder):
    dataset = shards.open_dataset(folder, seed=1)
    loader = shards.make_loader(dataset, batch_size=4, mode=WorkerProcesses(2, persistent=False), drop_last=False)
    assert sorted(rows_of(loader)) == list(range(25))
