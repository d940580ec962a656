"""The image-shard dataset: storages agree, slices read only what they need, shuffling is seeded, copies work."""

import pickle

import pytest
from PIL import Image

import shards
import shards.formats.hdf5 as hdf5_module
from shards.errors import InputError, MissingInputError
from shards.formats.tar import iter_tar_shard
from shards.formats.tarseek import iter_tar_slice
from tests.helpers import make_shard_dataset

SIZES = {"train": [7, 5, 9, 3], "val": [6, 6]}


@pytest.fixture(scope="module", params=["tar", "hdf5"])
def folder(tmp_path_factory, request):
    out = tmp_path_factory.mktemp(request.param)
    make_shard_dataset(out, shard_sizes=SIZES, storage=request.param, size=(16, 12))
    return out


def keys(dataset):
    return [key for _, _, key in dataset]


def test_yields_rgb_images_labels_and_keys(folder):
    dataset = shards.open_dataset(folder, split="val", return_keys=True, sampling=shards.Sampling(shuffle=False))
    image, label, key = next(iter(dataset))
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (16, 12)
    assert (label, key) == (0, "val_00000")
    assert len(dataset) == 12 and len(list(dataset)) == 12
    assert len(next(iter(shards.open_dataset(folder, split="val")))) == 2


def test_tar_and_hdf5_stream_the_same_order(tmp_path):
    orders = []
    for storage in ("tar", "hdf5"):
        make_shard_dataset(tmp_path / storage, shard_sizes=SIZES, storage=storage, size=(8, 8))
        orders.append(keys(shards.open_dataset(tmp_path / storage, return_keys=True, seed=6,
                                               distributed=shards.Distributed(world_size=2, rank=1))))
    assert orders[0] == orders[1]


def test_shuffle_is_seeded_and_changes_with_the_epoch(folder):
    def run(seed, epoch):
        dataset = shards.open_dataset(folder, return_keys=True, seed=seed, sampling=shards.Sampling(shuffle_buffer=5))
        dataset.set_epoch(epoch)
        return keys(dataset)
    base = run(1, 0)
    assert base == run(1, 0) and base != run(1, 1) and base != run(2, 0)
    assert sorted(base) == sorted(run(1, 1))
    in_order = shards.open_dataset(folder, return_keys=True, sampling=shards.Sampling(shuffle=False))
    assert keys(in_order) == [f"train_{i:05d}" for i in range(24)]


def test_hdf5_slices_read_only_their_samples(tmp_path, monkeypatch):
    make_shard_dataset(tmp_path, shard_sizes={"train": [40]}, storage="hdf5", size=(8, 8))
    calls = []
    original = hdf5_module.iter_hdf5_shard

    def spy(path, start=0, stop=None, **options):
        calls.append((start, stop))
        return original(path, start, stop, **options)

    monkeypatch.setattr(hdf5_module, "iter_hdf5_shard", spy)
    monkeypatch.setattr(hdf5_module, "HDF5_WINDOW", 8)
    dataset = shards.open_dataset(tmp_path, return_keys=True, sampling=shards.Sampling(shuffle=False),
                                  distributed=shards.Distributed(world_size=4, rank=2))
    assert keys(dataset) == [f"train_{i:05d}" for i in range(20, 30)]
    assert calls == [(20, 28), (28, 30)]


def test_tar_slices_seek_to_their_start(tmp_path):
    make_shard_dataset(tmp_path, shard_sizes={"train": [30]}, size=(8, 8))
    path = tmp_path / "train-000000.tar"
    everything = list(iter_tar_shard(path))
    assert list(iter_tar_slice(path)) == everything
    assert list(iter_tar_slice(path, 11, 17)) == everything[11:17]
    assert list(iter_tar_slice(path, 29, 99)) == everything[29:]


def test_dataset_pickles_with_its_epoch(folder):
    dataset = shards.open_dataset(folder, return_keys=True, seed=3)
    dataset.set_epoch(4)
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy.epoch == 4 and keys(copy) == keys(dataset)


def test_missing_shard_fails_at_open(tmp_path):
    make_shard_dataset(tmp_path, shard_sizes={"train": [2, 2]})
    (tmp_path / "train-000001.tar").unlink()
    with pytest.raises(MissingInputError, match="train-000001.tar"):
        shards.open_dataset(tmp_path)


def test_drop_last_reports_the_dropped_samples(folder):
    ranks = [shards.open_dataset(folder, return_keys=True, sampling=shards.Sampling(balance="drop"),
                                 distributed=shards.Distributed(world_size=5, rank=r)) for r in range(5)]
    assert {len(r) for r in ranks} == {4} and ranks[0].dropped == 4  # 24 samples over 5 ranks
    seen = [key for r in ranks for key in keys(r)]
    assert len(set(seen)) == 20 and not {f"train_{i:05d}" for i in range(20, 24)} & set(seen)


@pytest.mark.parametrize("options,field", [({"mode": "turbo"}, "Decode.mode"),
                                           ({"mode": "device"}, "Decode.mode='device' is not available"),
                                           ({"draft": 256}, "Decode.draft"),
                                           ({"mode": "fast", "draft": True}, "Decode.mode"),
                                           ({"draft": True, "decoder": str}, "Decode.draft"),
                                           ({"decoder": 42}, "Decode.decoder")])
def test_bad_decode_options_are_one_line_naming_the_field(options, field):
    with pytest.raises(InputError) as info:
        shards.Decode(**options)
    assert str(info.value).startswith(field) and "\n" not in str(info.value)


@pytest.mark.parametrize("make,field", [(lambda: shards.Sampling(balance="even"), "Sampling.balance='even'"),
                                        (lambda: shards.Sampling(shuffle="no"), "Sampling.shuffle='no'"),
                                        (lambda: shards.ShardCache(""), "ShardCache.dir"),
                                        (lambda: shards.ShardCache("c", limit="lots"), "ShardCache.limit='lots'"),
                                        (lambda: shards.ShardCache("c", limit=0), "ShardCache.limit")])
def test_bad_sampling_and_shard_cache_options_are_one_line_naming_the_field(make, field):
    with pytest.raises(InputError) as info:
        make()
    assert str(info.value).startswith(field) and "\n" not in str(info.value)


def test_draft_needs_a_preset_or_spec_and_a_custom_decoder_excludes_a_transform(folder):
    with pytest.raises(InputError, match="ImageDecoder"):
        shards.open_dataset(folder, transform=lambda image: image, decode=shards.Decode(draft=True))
    with pytest.raises(InputError, match="not both"):
        shards.open_dataset(folder, transform="eval", decode=shards.Decode(decoder=lambda sample, seed: sample.key))
    drafted = shards.open_dataset(folder, "val", transform="eval", decode=shards.Decode(draft=True),
                                  sampling=shards.Sampling(shuffle=False))
    assert len(list(drafted)) == len(drafted) == 12


