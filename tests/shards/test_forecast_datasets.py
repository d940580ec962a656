"""The forecast reads the dataset's own epoch source (``shards.forecast.plan.forecast(dataset, mode, epochs)``): a
mixture, a subset, class weights and feature rows are forecast like a plain folder, and the shards each reader of
the forecast reads, in order, are the shards the loader reads."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest

import shards
from shards.forecast.plan import forecast
from shards.loader.in_process import InProcess
from shards.loader.threads import Threads
from shards.select.mixture import SourceSpec, Subset
from tests.helpers import make_shard_dataset
from tests.shards.label_columns import add_label_columns
from tests.shards.stream_helpers import write_feature_dataset


def no_decode(sample, seed):
    return 0


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("forecast_datasets")
    make_shard_dataset(root / "big", shard_sizes={"train": [7, 5, 9, 3]}, size=(8, 8))
    add_label_columns(root / "big")  # the labels class weighting draws by
    make_shard_dataset(root / "small", shard_sizes={"train": [4, 6]}, size=(8, 8))
    write_feature_dataset(root / "features", [10, 11, 6])
    return root


def opened(folders, kind: str, **options):
    decode = shards.Decode(decoder=no_decode)
    if kind == "plain":
        return shards.open_dataset(folders / "big", "train", seed=3, decode=decode, **options)
    if kind == "mixture":
        sources = [SourceSpec(folders / "big", weight=1), SourceSpec(folders / "small", weight=3)]
        return shards.open_dataset(sources, "train", seed=3, decode=decode, **options)
    if kind == "subset":
        source = SourceSpec(folders / "big", subset=Subset(classes=["a", "c"]))
        return shards.open_dataset([source], "train", seed=3, decode=decode, **options)
    if kind == "weighted":
        return shards.open_dataset(folders / "big", "train", seed=3, decode=decode,
                                   sampling=shards.Sampling(class_weights=(1.0, 0.0, 4.0)), **options)
    assert kind == "features"
    return shards.open_dataset(folders / "features", "train", seed=3, **options)


def shards_read(dataset, loader, epoch: int) -> dict[str, list[int]]:
    """Per reading thread, the shards ``dataset`` read for one epoch of ``loader``, in order (its reads watched)."""
    read: dict[str, list[int]] = defaultdict(list)
    plain_read = dataset.read_resync  # what the stream reads each covering read through

    def watched(piece):
        read[threading.current_thread().name].append(piece.shard)
        return plain_read(piece)

    dataset.read_resync = watched
    try:
        dataset.set_epoch(epoch)
        for _ in loader:
            pass
    finally:
        del dataset.read_resync
    return dict(read)


@pytest.mark.parametrize("kind", ["plain", "mixture", "subset", "weighted"])
@pytest.mark.parametrize("mode", [InProcess(), Threads(2)], ids=str)
def test_each_reader_reads_the_shards_the_loader_reads_in_order(folders, kind, mode):
    dataset = opened(folders, kind)
    result = forecast(dataset, mode, 2, batch_size=4)
    loader = shards.make_loader(dataset, 4, mode=mode, drop_last=False)
    for epoch in range(2):
        read = shards_read(dataset, loader, epoch)
        probe = read.pop("MainThread", []) if isinstance(mode, Threads) else []
        # the main thread of a thread run reads only the first samples of a worker's stream, to probe the transform
        assert any(order[:len(probe)] == probe for order in read.values())
        forecast_order = result.ranks[epoch][0].shard_order
        assert sorted(read.values()) == sorted(order for order in forecast_order.values() if order)
        assert result.ranks[epoch][0].reads == sum(len(order) for order in read.values())
    assert result.ranks[0][0].samples == len(dataset)  # one rank: the epoch the loader feeds


@pytest.mark.parametrize("kind", ["mixture", "subset", "weighted", "features"])
def test_every_kind_of_dataset_gets_a_forecast_of_its_own_rows(folders, kind):
    for world_size in (1, 2):
        dataset = opened(folders, kind, distributed=shards.Distributed(rank=0, world_size=world_size))
        result = forecast(dataset, None, 2, batch_size=4)
        for epoch in range(2):
            assert all(part.samples == len(dataset) > 0 for part in result.ranks[epoch])  # each rank's share
            assert result.epoch_total(epoch).local.bytes > 0 and result.epoch_total(epoch).source.requests == 0
        out = result.to_dict()
        assert out["settings"]["world_size"] == world_size and out["settings"]["mode"]["kind"] in ("processes",
                                                                                                   "in-process")


def test_a_subset_is_forecast_over_its_own_rows_not_the_folder(folders):
    plain = forecast(opened(folders, "plain"), InProcess(), 1, batch_size=4)
    subset = forecast(opened(folders, "subset"), InProcess(), 1, batch_size=4)
    assert plain.ranks[0][0].samples == 24 and subset.ranks[0][0].samples == 16  # classes a and c of a, b, c
    assert 0 < subset.epoch_total(0).local.bytes < plain.epoch_total(0).local.bytes


def test_a_feature_dataset_in_process_is_forecast_as_one_whole_permutation(folders):
    dataset = opened(folders, "features")
    result = forecast(dataset, None, 1, batch_size=4)  # make_loader's default there: InProcess()
    assert result.to_dict()["settings"]["mode"] == {"kind": "in-process"}
    assert result.ranks[0][0].samples == 27 and sorted(result.ranks[0][0].shard_order[0]) == [0, 1, 2]
