"""Corrupt data: a clear error naming shard and key, or counted skips that keep the epoch length; no unpickling."""

import io
import pickle
import tarfile

import pytest

import shards
from shards.errors import CorruptDataError, InputError
from shards.loader.worker_processes import WorkerProcesses
from tests.shards.stream_helpers import write_labelled_shards

SKIP = shards.ErrorPolicy(on_error="skip")


@pytest.mark.parametrize("storage", ["tar", "hdf5"])
def test_undecodable_sample_names_shard_and_key(tmp_path, storage):
    write_labelled_shards(tmp_path, [[0, 1, 2], [0, 1]], storage=storage, bad_keys=["s00003"])
    with pytest.raises(CorruptDataError) as info:
        list(shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False)))
    assert info.value.key == "s00003"
    assert "train-000001" in str(info.value) and "s00003" in str(info.value)


def test_skip_counts_and_keeps_the_epoch_length(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1, 2, 0], [1, 2, 0]], bad_keys=["s00001", "s00005"])
    dataset = shards.open_dataset(tmp_path, errors=SKIP, return_keys=True, sampling=shards.Sampling(shuffle=False))
    got = [key for _, _, key in dataset]
    assert len(got) == len(dataset) == 7
    assert "s00001" not in got and "s00005" not in got
    assert got == ["s00000", "s00000", "s00002", "s00003", "s00004", "s00004", "s00006"]
    assert dataset.skipped == 2


def test_skip_counts_across_workers(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1, 2, 0], [1, 2, 0]], bad_keys=["s00001", "s00005"])
    dataset = shards.open_dataset(tmp_path, errors=SKIP, transform="eval")
    loader = shards.make_loader(dataset, batch_size=2, mode=WorkerProcesses(2, persistent=False), drop_last=False)
    assert sum(len(labels) for _, labels in loader) == 7
    assert dataset.skipped == 2


def test_skip_stops_after_too_many_consecutive_failures(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1, 2, 0, 1, 2]], bad_keys=["s00001", "s00002", "s00003"])
    errors = shards.ErrorPolicy(on_error="skip", max_consecutive_errors=3)
    dataset = shards.open_dataset(tmp_path, errors=errors, sampling=shards.Sampling(shuffle=False))
    with pytest.raises(CorruptDataError, match="3 consecutive"):
        list(dataset)


def test_truncated_tar_names_the_shard(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1, 2], [0, 1, 2]])
    shard = tmp_path / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:1500])
    with pytest.raises(CorruptDataError, match="train-000001.tar"):
        list(shards.open_dataset(tmp_path, sampling=shards.Sampling(shuffle=False)))
    skipping = shards.open_dataset(tmp_path, errors=SKIP, sampling=shards.Sampling(shuffle=False))
    assert len(list(skipping)) == 6 and skipping.skipped >= 1


class Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled!')",))


def test_unknown_members_are_ignored_and_never_unpickled(tmp_path):
    write_labelled_shards(tmp_path, [[0, 1]])
    shard = tmp_path / "train-000000.tar"
    original = shard.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(original)) as src:
        members = [(m, src.extractfile(m).read()) for m in src.getmembers()]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as out:
        for member, data in members:
            out.addfile(member, io.BytesIO(data))
            if member.name.endswith(".cls"):
                evil = pickle.dumps(Boom())
                info = tarfile.TarInfo(member.name.replace(".cls", ".pyd"))
                info.size = len(evil)
                out.addfile(info, io.BytesIO(evil))
    shard.write_bytes(buffer.getvalue())
    got = list(shards.open_dataset(tmp_path, return_keys=True, sampling=shards.Sampling(shuffle=False)))
    assert [(label, key) for _, label, key in got] == [(0, "s00000"), (1, "s00001")]


@pytest.mark.parametrize("options,field", [({"on_error": "ignore"}, "ErrorPolicy.on_error"),
                                           ({"max_consecutive_errors": 0}, "ErrorPolicy.max_consecutive_errors")])
def test_a_bad_error_policy_is_one_line_naming_the_field(options, field):
    with pytest.raises(InputError) as info:
        shards.ErrorPolicy(**options)
    assert str(info.value).startswith(field) and "\n" not in str(info.value)
