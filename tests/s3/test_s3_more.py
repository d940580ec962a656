"""Object storage, the less travelled paths: uploads in parts above the multipart threshold, the one-line hint when
the ``s3`` extra is not installed, and named profiles of ``~/.aws/config`` (endpoint and keys from the profile).

Only the tests that talk to the server carry the ``s3`` mark: the missing-extra test runs everywhere, the
unknown-profile test wherever boto3 is installed.
"""

from __future__ import annotations

import hashlib
import json
import sys

import pytest
import torch
from click.testing import CliRunner

import shards
import shards.publish.s3_upload as s3_upload
from preprocess.features.state import features_spec
from preprocess.pack.parts import dataset_spec
from shards.errors import InputError
from shards.transport import s3
from shards.manifest import DATASET_FILE, FEATURES_FILE
from tests.helpers import make_shard_dataset, write_image_folder
from tests.s3.server import ACCESS_KEY, SECRET_KEY
from tests.shards.stream_helpers import write_feature_dataset

S3_MIN_PART = 5 << 20  # S3's smallest part but the last; boto3 raises a smaller chunk size to it


def raw(sample, seed):
    return sample.key, sample.data


def multipart_etag(data: bytes, part_size: int) -> str:
    """The ETag S3 gives an object uploaded in parts of ``part_size``: md5 of the parts' md5s, ``-<parts>``."""
    parts = [data[start:start + part_size] for start in range(0, len(data), part_size)]
    digest = hashlib.md5(b"".join(hashlib.md5(part).digest() for part in parts)).hexdigest()
    return f"{digest}-{len(parts)}"


def head(bucket, name: str) -> dict:
    return bucket.client.head_object(Bucket=bucket.name, Key=f"{bucket.prefix}/{name}")


def body(bucket, name: str) -> bytes:
    return bucket.client.get_object(Bucket=bucket.name, Key=f"{bucket.prefix}/{name}")["Body"].read()


# -- multipart uploads ------------------------------------------------------------------------------------------------
@pytest.mark.s3
@pytest.mark.slow
def test_shards_at_the_threshold_go_up_in_parts_and_smaller_files_in_one_put(bucket, tmp_path, monkeypatch, s3_env):
    local = tmp_path / "data"
    manifest = make_shard_dataset(local, shard_sizes={"train": [4, 6], "val": [3]})
    shard_infos = [info for split in manifest.splits.values() for info in split.shards]
    threshold = min(info.bytes for info in shard_infos)
    assert (local / DATASET_FILE).stat().st_size < threshold  # so the manifest goes up in one PUT
    monkeypatch.setattr(s3_upload, "MULTIPART_THRESHOLD", threshold)

    stats = s3_upload.publish_folder(local, bucket.url("ds"), dataset_spec(),
                                     options=s3.S3Options(endpoint_url=s3_env.endpoint_url))

    assert stats.uploaded[-1] == DATASET_FILE and len(stats.uploaded) == len(shard_infos) + 1
    for info in shard_infos:
        data = (local / info.path).read_bytes()
        assert body(bucket, f"ds/{info.path}") == data
        described = head(bucket, f"ds/{info.path}")
        # One part (boto3 never cuts parts below 5 MiB), but a multipart upload: the ETag says "-1".
        assert described["ETag"].strip('"') == multipart_etag(data, S3_MIN_PART)
        assert described["ContentLength"] == info.bytes
        assert described["Metadata"]["sha256"] == info.sha256 == hashlib.sha256(data).hexdigest()
    manifest_etag = head(bucket, f"ds/{DATASET_FILE}")["ETag"].strip('"')
    assert manifest_etag == hashlib.md5((local / DATASET_FILE).read_bytes()).hexdigest()  # a plain PUT: no "-N"

    again = s3_upload.publish_folder(local, bucket.url("ds"), dataset_spec(),
                                     options=s3.S3Options(endpoint_url=s3_env.endpoint_url))
    assert again.uploaded == () and set(again.skipped) == {info.path for info in shard_infos} | {DATASET_FILE}


@pytest.mark.s3
@pytest.mark.slow
def test_a_shard_of_several_parts_is_reassembled_in_order_and_reads_back(bucket, tmp_path, monkeypatch, s3_env):
    local = tmp_path / "features"
    manifest = write_feature_dataset(local, [5600, 7], dim=1024)  # float16: an 11 MiB shard, then a small one
    big, small = manifest.splits["train"].shards
    assert 2 * S3_MIN_PART < big.bytes < 3 * S3_MIN_PART and small.bytes < S3_MIN_PART
    monkeypatch.setattr(s3_upload, "MULTIPART_THRESHOLD", S3_MIN_PART)
    monkeypatch.setattr(s3_upload, "MULTIPART_CHUNK", S3_MIN_PART)

    stats = s3_upload.publish_folder(local, bucket.url("feat"), features_spec())

    assert set(stats.uploaded) == {big.path, small.path, FEATURES_FILE}
    data = (local / big.path).read_bytes()
    assert body(bucket, f"feat/{big.path}") == data
    described = head(bucket, f"feat/{big.path}")
    assert described["ETag"].strip('"') == multipart_etag(data, S3_MIN_PART)
    assert described["ETag"].strip('"').endswith("-3")
    assert described["ContentLength"] == big.bytes and described["Metadata"]["sha256"] == big.sha256
    assert "-" not in head(bucket, f"feat/{small.path}")["ETag"]
    assert s3_upload.object_state(bucket.url("feat", big.path)) == (big.bytes, big.sha256)

    remote = shards.open_dataset(bucket.url("feat"), "train", return_keys=True, sampling=shards.Sampling(shuffle=False),
                                 distributed=shards.Distributed(rank=0, world_size=1))
    here = shards.open_dataset(local, "train", return_keys=True, sampling=shards.Sampling(shuffle=False),
                               distributed=shards.Distributed(rank=0, world_size=1))
    for (got, got_label, got_key), (want, want_label, want_key) in zip(remote, here, strict=True):
        assert got_key == want_key and int(got_label) == int(want_label) and torch.equal(got, want)


@pytest.mark.s3
@pytest.mark.slow
def test_pack_shards_to_s3_uploads_in_parts_above_the_patched_threshold(bucket, tmp_path, monkeypatch, s3_env):
    from preprocess.pack.cli import pack_shards_command

    src = write_image_folder(tmp_path / "src", ["a", "b"], per_class=6)
    monkeypatch.setattr(s3_upload, "MULTIPART_THRESHOLD", 4096)
    result = CliRunner().invoke(pack_shards_command, [str(src), "--out", bucket.url("ds"), "--stage-dir",
                                                     str(tmp_path / "stage"), "--shard-samples", "5", "--quiet"])
    assert result.exit_code == 0, result.output
    manifest = json.loads(body(bucket, f"ds/{DATASET_FILE}"))
    named = [shard["path"] for split in manifest["splits"].values() for shard in split["shards"]]
    assert named
    for name in named:
        data = (tmp_path / "stage" / name).read_bytes()
        assert len(data) >= 4096 and body(bucket, f"ds/{name}") == data
        assert head(bucket, f"ds/{name}")["ETag"].strip('"') == multipart_etag(data, S3_MIN_PART)


# -- without the s3 extra ---------------------------------------------------------------------------------------------
@pytest.fixture
def without_boto3(monkeypatch):
    """boto3 and botocore not importable (``None`` in ``sys.modules`` makes ``import`` raise ImportError)."""
    for name in [name for name in sys.modules if name.split(".")[0] in ("boto3", "botocore")] + ["boto3",
                                                                                                  "botocore"]:
        monkeypatch.setitem(sys.modules, name, None)
    s3.forget_clients()
    yield
    s3.forget_clients()


def test_without_boto3_an_s3_path_names_the_extra_to_install(without_boto3, tmp_path):
    from preprocess.pack.cli import pack_shards_command
    from shards.cli.main import main

    with pytest.raises(InputError) as failure:
        shards.open_dataset("s3://bucket/x", "train")
    message = str(failure.value)
    assert "shardcache[s3]" in message and "boto3" in message and "\n" not in message
    with pytest.raises(InputError, match=r"shardcache\[s3\]"):
        s3.make_client()

    src = write_image_folder(tmp_path / "src", ["a", "b"], per_class=2)
    for command, args in ((main, ["inspect", "s3://bucket/x"]), (main, ["verify", "s3://bucket/x"]),
                          (pack_shards_command, [str(src), "--out", "s3://bucket/x", "--stage-dir",
                                                 str(tmp_path / "stage")])):
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "pip install 'shardcache[s3]'" in lines[0]
    assert not (tmp_path / "stage" / DATASET_FILE).exists()  # refused before any local work


# -- named profiles ---------------------------------------------------------------------------------------------------
WRONG_SECRET = "wrong-secret-for-shardtest-0000"


@pytest.fixture
def profiles(s3_env, monkeypatch, tmp_path):
    """``AWS_CONFIG_FILE``/``AWS_SHARED_CREDENTIALS_FILE`` with profiles ``shardtest`` (the server's endpoint and
    keys) and ``badkeys`` (same endpoint, a wrong secret); no keys or endpoint in the environment."""
    config, credentials = tmp_path / "profiles-config", tmp_path / "profiles-credentials"
    config.write_text(f"[profile shardtest]\nregion = us-east-1\nendpoint_url = {s3_env.endpoint_url}\n\n"
                      f"[profile badkeys]\nregion = us-east-1\nendpoint_url = {s3_env.endpoint_url}\n")
    credentials.write_text(f"[shardtest]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n\n"
                           f"[badkeys]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {WRONG_SECRET}\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                 "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    s3.forget_clients()
    yield
    s3.forget_clients()


def uploaded(bucket, tmp_path):
    """A small dataset, locally and as uploaded to the bucket."""
    local = tmp_path / "data"
    make_shard_dataset(local, shard_sizes={"train": [4, 3]})
    return local, bucket.upload(local, "data")


def keyed_samples(url, **options):
    dataset = shards.open_dataset(url, "train", return_keys=True, decode=shards.Decode(decoder=raw), **options,
                                  sampling=shards.Sampling(shuffle=False),
                                  distributed=shards.Distributed(rank=0, world_size=1))
    return [(key, data, int(label)) for (key, data), label, _ in dataset]


@pytest.mark.s3
@pytest.mark.slow
def test_a_named_profile_supplies_the_endpoint_and_the_keys(bucket, tmp_path, profiles):
    from shards.cli.main import main

    local, url = uploaded(bucket, tmp_path)
    assert keyed_samples(url, remote=shards.Remote(storage_options={"profile": "shardtest"})) == keyed_samples(local)
    result = CliRunner().invoke(main, ["verify", url, "--s3-profile", "shardtest"])
    assert result.exit_code == 0, result.output


@pytest.mark.s3
@pytest.mark.slow
def test_a_profile_with_wrong_keys_is_a_one_line_403_without_the_secret(bucket, tmp_path, profiles):
    from shards.cli.main import main

    local, url = uploaded(bucket, tmp_path)
    with pytest.raises(s3.S3AccessDenied) as failure:
        shards.open_dataset(url, "train", remote=shards.Remote(storage_options={"profile": "badkeys"}))
    message = str(failure.value)
    assert "403" in message and url in message and "\n" not in message
    assert WRONG_SECRET not in message and SECRET_KEY not in message
    for args in (["inspect", url, "--s3-profile", "badkeys"], ["verify", url, "--s3-profile", "badkeys"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "403" in lines[0] and url in lines[0]
        assert WRONG_SECRET not in result.output and SECRET_KEY not in result.output


def test_an_unknown_profile_is_named_in_a_one_line_error(monkeypatch, tmp_path):
    pytest.importorskip("boto3")  # needs botocore's configuration chain, not the server
    (tmp_path / "config").write_text("[profile shardtest]\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    s3.forget_clients()
    try:
        with pytest.raises(InputError, match="'no-such-profile' not found") as failure:
            shards.open_dataset("s3://bucket/data", "train",
                                remote=shards.Remote(storage_options={"profile": "no-such-profile"}))
    finally:
        s3.forget_clients()
    assert "\n" not in str(failure.value)
