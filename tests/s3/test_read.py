"""Reading datasets from object storage (a local SeaweedFS): the same samples as from disk, only the bytes a slice
needs, faults retried and resumed, and refusals (403, 404) final, one line, without secrets."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import shards
from shards.errors import CorruptDataError, MissingInputError
from shards.transport import s3
from shards.transport import s3_ranges
from shards.order.plan import ShardSlice
from tests.helpers import make_shard_dataset
from tests.s3.faults import FaultProxy, Faults
from tests.s3.server import SECRET_KEY
from tests.shards.stream_helpers import write_feature_dataset

pytestmark = pytest.mark.s3
SIZES = {"train": [7, 5, 9], "val": [4]}


def raw(sample, seed):
    return sample.key, sample.data


def packed(folder: Path, storage: str = "tar") -> Path:
    """A dataset with the writers' per-sample tar index recorded in dataset.json (as pack-shards records it)."""
    make_shard_dataset(folder, shard_sizes=SIZES, storage=storage)
    manifest = json.loads((folder / "dataset.json").read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            index = folder / (shard["path"] + ".idx")
            if index.exists():
                shard["index"] = index.name
                shard["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    (folder / "dataset.json").write_text(json.dumps(manifest))
    return folder


def samples(path, split="train", **options):
    dataset = shards.open_dataset(path, split, return_keys=True, decode=shards.Decode(decoder=raw), **options,
                                  sampling=shards.Sampling(shuffle=False),
                                  distributed=shards.Distributed(rank=0, world_size=1))
    return [(key, data, int(label)) for (key, data), label, _ in dataset]


def drop_index(bucket, url: str) -> None:
    key = url.removeprefix(f"s3://{bucket.name}/") + "/dataset.json"
    manifest = json.loads(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            shard.pop("index", None)
            shard.pop("index_sha256", None)
    bucket.client.put_object(Bucket=bucket.name, Key=key, Body=json.dumps(manifest).encode())


@pytest.mark.parametrize("case", ["tar-indexed", "tar-no-index", "hdf5"])
@pytest.mark.slow
def test_open_dataset_over_s3_yields_the_local_samples_in_order(bucket, tmp_path, case):
    local = packed(tmp_path / "data", "hdf5" if case == "hdf5" else "tar")
    url = bucket.upload(local, "data")
    if case == "tar-no-index":
        drop_index(bucket, url)
    for split in ("train", "val"):
        expected = samples(local, split)
        assert samples(url, split) == expected
        assert samples(url + "/", split) == expected


@pytest.mark.slow
def test_two_workers_read_the_same_samples(bucket, tmp_path):
    local = packed(tmp_path / "data")
    url = bucket.upload(local, "data")

    def epoch(path):
        dataset = shards.open_dataset(path, "train", seed=3, return_keys=True, decode=shards.Decode(decoder=raw),
                                      distributed=shards.Distributed(rank=0, world_size=1))
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)
        return [(key, data) for (key, data), _, _ in loader]

    assert epoch(url) == epoch(local)


@pytest.mark.slow
def test_a_slice_fetches_only_its_bytes_and_the_index(bucket, tmp_path):
    local = packed(tmp_path / "data")
    url = bucket.upload(local, "data")
    dataset = shards.open_dataset(url, "train", sampling=shards.Sampling(shuffle=False),
                                  distributed=shards.Distributed(rank=0, world_size=1))
    info = dataset.split_info.shards[2]
    index = (local / info.index).read_bytes()
    from shards.formats.tarindex import read_index

    offsets = read_index(index, "x", info.samples, info.bytes)
    s3.FETCH_STATS.reset()
    keys = [sample.key for sample in dataset.read_slice(ShardSlice(2, 3, 6))]
    assert len(keys) == 3
    assert s3.FETCH_STATS.bytes == len(index) + int(offsets[6] - offsets[3])
    assert s3.FETCH_STATS.requests == 2
    s3.FETCH_STATS.reset()
    assert len(list(dataset.read_slice(ShardSlice(2, 0, 2)))) == 2  # the index is fetched once per process
    assert s3.FETCH_STATS.bytes == int(offsets[2]) and s3.FETCH_STATS.requests == 1


@pytest.mark.slow
def test_feature_folder_round_trip(bucket, tmp_path):
    local = tmp_path / "features"
    write_feature_dataset(local, [5, 3, 6])
    url = bucket.upload(local, "features")
    local_rows = list(shards.open_dataset(local, "train", return_keys=True, sampling=shards.Sampling(shuffle=False),
                                          distributed=shards.Distributed(rank=0, world_size=1)))
    s3_rows = list(shards.open_dataset(url, "train", return_keys=True, sampling=shards.Sampling(shuffle=False),
                                       distributed=shards.Distributed(rank=0, world_size=1)))
    assert [(k, int(l)) for _, l, k in s3_rows] == [(k, int(l)) for _, l, k in local_rows]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(s3_rows, local_rows))
    loader = shards.make_loader(shards.open_dataset(url, "train", seed=1,
                                                    distributed=shards.Distributed(rank=0, world_size=1)), batch_size=4)
    local_set = shards.open_dataset(local, "train", seed=1, distributed=shards.Distributed(rank=0, world_size=1))
    local_loader = shards.make_loader(local_set, batch_size=4)
    for (f1, l1), (f2, l2) in zip(loader, local_loader, strict=True):
        assert torch.equal(f1, f2) and torch.equal(l1, l2)


@pytest.mark.slow
def test_a_replaced_feature_shard_is_refused(bucket, tmp_path):
    local = tmp_path / "features"
    write_feature_dataset(local, [5])
    url = bucket.upload(local, "features")
    bucket.put("features/train-000000.pt", (local / "train-000000.pt").read_bytes()[:-10] + b"0" * 10)
    with pytest.raises(CorruptDataError, match="sha256"):
        list(shards.open_dataset(url, "train", distributed=shards.Distributed(rank=0, world_size=1)))


@pytest.mark.slow
def test_faults_are_retried_and_resumed_to_the_same_samples(bucket, tmp_path, s3_env):
    local = packed(tmp_path / "data")
    url = bucket.upload(local, "data")
    url_plain = bucket.upload(local, "plain")
    drop_index(bucket, url_plain)
    expected = samples(local)
    # Request 0 (dataset.json) and its retries 1-2 get 503 SlowDown; every shard's first body breaks at byte 700.
    faults = Faults(slow_down_first=3, reset_once_suffix=".tar", reset_after_bytes=700)
    with FaultProxy(s3_env.endpoint_url, faults) as proxy:
        options = shards.Remote(storage_options={"endpoint_url": proxy.endpoint_url})
        assert samples(url, remote=options) == expected
        assert [status for *_, status in proxy.requests[:3]] == [503, 503, 503]
        assert len(proxy.resets) >= 3, proxy.requests
        for number in proxy.resets:
            _, path, byte_range, _ = proxy.requests[number]
            retry = next(r for r in proxy.requests[number + 1:] if r[1] == path)  # reads ahead run beside it
            start = int(byte_range.split("=")[1].split("-")[0]) if byte_range else 0
            assert retry[1] == path and retry[2].startswith(f"bytes={start + 700}-")  # resumed where it broke
        proxy.requests.clear()
        proxy.resets.clear()
        proxy.faults = Faults(reset_once_suffix=".tar", reset_after_bytes=700)
        proxy._reset_paths.clear()
        assert samples(url_plain, remote=options) == expected
        assert proxy.resets


@pytest.mark.slow
def test_too_many_failures_name_the_url_and_the_last_cause(bucket, tmp_path, s3_env):
    url = bucket.put("blob.bin", b"x" * 5000)
    with FaultProxy(s3_env.endpoint_url, Faults(slow_down_first=100)) as proxy:
        options = s3.S3Options(endpoint_url=proxy.endpoint_url, max_attempts=3)
        with pytest.raises(CorruptDataError) as failure:
            s3_ranges.read_object(url, options)
        assert len(proxy.gets()) == 3
    message = str(failure.value)
    assert url in message and "3 attempts" in message and "SlowDown" in message and "\n" not in message


@pytest.mark.slow
def test_missing_object_is_404_and_not_retried(bucket, s3_env):
    with FaultProxy(s3_env.endpoint_url) as proxy:
        options = shards.Remote(storage_options={"endpoint_url": proxy.endpoint_url})
        with pytest.raises(MissingInputError, match="404"):
            shards.open_dataset(bucket.url("nothing-here"), remote=options)
        assert len(proxy.gets()) == 2  # dataset.json, then features.json: once each


@pytest.mark.slow
def test_wrong_keys_are_a_one_line_403_exit_2(bucket, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from shards.cli.main import main

    url = bucket.upload(packed(tmp_path / "data"), "data")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-key")
    s3.forget_clients()
    for args in (["inspect", url], ["verify", url]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "403" in lines[0] and url in lines[0]
        assert "not-the-secret-key" not in result.output and SECRET_KEY not in result.output


@pytest.mark.slow
def test_unsigned_requests_are_refused_by_a_private_bucket(bucket, tmp_path):
    url = bucket.upload(packed(tmp_path / "data"), "data")
    with pytest.raises(s3.S3AccessDenied, match="403"):
        shards.open_dataset(url, remote=shards.Remote(storage_options={"unsigned": True}))


def test_storage_options_refuse_credentials_and_unknown_fields():
    with pytest.raises(ValueError, match="credentials are not options"):
        s3.S3Options.from_mapping({"secret_access_key": "x"})
    with pytest.raises(ValueError, match="endpoint"):
        s3.S3Options.from_mapping({"endpoint": "http://x"})


@pytest.mark.parametrize("storage", ["tar", "hdf5"])
@pytest.mark.slow
def test_shards_verify_and_inspect_read_s3(bucket, tmp_path, storage):
    from click.testing import CliRunner

    from shards.cli.main import main

    local = packed(tmp_path / "data", storage)
    url = bucket.upload(local, "data")
    result = CliRunner().invoke(main, ["verify", url, "--full"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["samples_read"] == 25
    result = CliRunner().invoke(main, ["inspect", url, "--batch", "--batch-size", "4"])
    assert result.exit_code == 0, result.output
    bucket.put("data/train-000001" + (".tar" if storage == "tar" else ".h5"), b"broken")
    result = CliRunner().invoke(main, ["verify", url])
    assert result.exit_code == 1 and "train-000001" in result.output


@pytest.mark.slow
def test_shards_verify_reads_an_s3_feature_folder(bucket, tmp_path):
    from click.testing import CliRunner

    from shards.cli.main import main

    local = tmp_path / "features"
    write_feature_dataset(local, [5, 3])
    url = bucket.upload(local, "features")
    result = CliRunner().invoke(main, ["verify", url])
    assert result.exit_code == 0, result.output


@pytest.mark.slow
def test_train_from_shards_dry_run_reads_s3(bucket, tmp_path):
    from click.testing import CliRunner

    from train.cli import train_command

    local = tmp_path / "features"
    write_feature_dataset(local, [6, 6])
    manifest = json.loads((local / "features.json").read_text())
    manifest["splits"]["val"] = manifest["splits"]["train"]
    (local / "features.json").write_text(json.dumps(manifest))
    url = bucket.upload(local, "features")
    images = bucket.upload(packed(tmp_path / "data"), "data")
    for data, extra in ((url, []), (images, ["--image-size", "32"])):  # --image-size applies to images only
        result = CliRunner().invoke(train_command, [data, "--out", str(tmp_path / "run"), "--dry-run",
                                                    "--batch-size", "4", "--workers", "0", *extra])
        assert result.exit_code == 0, result.output
