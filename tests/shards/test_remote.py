"""Remote shards: the same samples over http:// (a local server started here) and through pipe: commands."""


import pytest

import shards
from shards.errors import InputError
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset, serve_folder


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    make_shard_dataset(folder, shard_sizes={"train": [4, 3, 5]}, size=(16, 16))
    with serve_folder(folder) as url:
        yield folder, url


def keys(dataset):
    return [key for _, _, key in dataset]


def test_http_manifest_and_shards_match_local(served):
    folder, url = served
    local = keys(shards.open_dataset(folder, return_keys=True, seed=2))
    remote = shards.open_dataset(url, return_keys=True, seed=2)
    assert keys(remote) == local
    assert remote.locations[0].startswith("http://127.0.0.1")


def test_http_through_workers_with_slices(served):
    folder, url = served
    dataset = shards.open_dataset(url + "/dataset.json", return_keys=True, transform="eval",
                                  distributed=shards.Distributed(world_size=2, rank=1))
    loader = shards.make_loader(dataset, batch_size=2, mode=WorkerProcesses(2, persistent=False), drop_last=False)
    got = [k for batch in loader for k in batch[2]]
    local = shards.open_dataset(folder, return_keys=True, transform="eval",
                                distributed=shards.Distributed(world_size=2, rank=1))
    assert sorted(got) == sorted(keys(local)) and len(got) == 6


def test_local_manifest_with_base_url(served):
    folder, url = served
    dataset = shards.open_dataset(folder, return_keys=True, remote=shards.Remote(url),
                                  sampling=shards.Sampling(shuffle=False))
    assert dataset.locations[1] == f"{url}/train-000001.tar"
    assert keys(dataset) == [f"train_{i:05d}" for i in range(12)]


def test_pipe_command(served):
    folder, _ = served
    dataset = shards.open_dataset(folder, return_keys=True, sampling=shards.Sampling(shuffle=False))
    dataset.locations = [f"pipe:cat {location}" for location in dataset.locations]
    assert keys(dataset) == [f"train_{i:05d}" for i in range(12)]


def test_missing_remote_shard_names_the_url(served):
    folder, url = served
    dataset = shards.open_dataset(folder, remote=shards.Remote(url + "/nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere/train-0000"):
        list(dataset)


def test_hdf5_must_be_local(tmp_path):
    make_shard_dataset(tmp_path, shard_sizes={"train": [2]}, storage="hdf5")
    with pytest.raises(InputError, match="local"):
        shards.open_dataset(tmp_path, remote=shards.Remote("http://127.0.0.1:9/"))
