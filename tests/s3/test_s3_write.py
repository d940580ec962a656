"""Writing to object storage: ``pack-shards``/``precompute-features --out s3://...`` stage locally, upload every
object not already complete (checked by size and sha256 metadata), and upload the manifest last."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import shards.publish.s3_upload as s3_upload
from shards.formats.columns import column_files
from preprocess.pack.cli import pack_shards_command
from tests.helpers import write_image_folder

pytestmark = [pytest.mark.s3, pytest.mark.slow]  # slow: starting and stopping SeaweedFS takes seconds


@pytest.fixture
def src(tmp_path) -> Path:
    return write_image_folder(tmp_path / "src", ["a", "b"], per_class=6)


@pytest.fixture
def uploads(monkeypatch):
    """Every object name uploaded, in order."""
    names: list[str] = []
    real = s3_upload.upload_file

    def counting(client, path, bucket, key, **kwargs):
        real(client, path, bucket, key, **kwargs)
        names.append(key.rsplit("/", 1)[-1])

    monkeypatch.setattr(s3_upload, "upload_file", counting)
    return names


def _pack(src: Path, url: str, stage: Path, *extra: str):
    return CliRunner().invoke(pack_shards_command, [str(src), "--out", url, "--stage-dir", str(stage),
                                                   "--shard-samples", "5", "--quiet", *extra])


def _objects(bucket) -> dict[str, bytes]:
    listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=f"{bucket.prefix}/ds/")
    return {item["Key"].rsplit("/", 1)[-1]: bucket.client.get_object(Bucket=bucket.name, Key=item["Key"])["Body"]
            .read() for item in listed.get("Contents", [])}


def test_pack_to_s3_uploads_byte_identical_objects_manifest_last(src, bucket, tmp_path, uploads):
    result = _pack(src, bucket.url("ds"), tmp_path / "stage")
    assert result.exit_code == 0, result.output
    stage = tmp_path / "stage"
    objects = _objects(bucket)
    manifest = json.loads(objects["dataset.json"])
    named = [s["path"] for split in manifest["splits"].values() for s in split["shards"]]
    assert uploads[-1] == "dataset.json" and len(named) == 3
    for name in [*named, *(n + ".idx" for n in named), "source-index.jsonl", "dataset.json"]:
        assert objects[name] == (stage / name).read_bytes()
    head = bucket.client.head_object(Bucket=bucket.name, Key=f"{bucket.prefix}/ds/{named[0]}")
    assert head["Metadata"]["sha256"] == hashlib.sha256(objects[named[0]]).hexdigest()
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["out"] == bucket.url("ds") and summary["upload"]["uploaded"] == len(uploads)


def test_pack_to_s3_reads_back_through_open_dataset(src, bucket, tmp_path, s3_env):
    import shards

    assert _pack(src, bucket.url("ds"), tmp_path / "stage").exit_code == 0
    remote = shards.Remote(storage_options={"endpoint_url": s3_env.endpoint_url})
    dataset = shards.open_dataset(bucket.url("ds"), split="train", return_keys=True, remote=remote,
                                  sampling=shards.Sampling(shuffle=False))
    local = shards.open_dataset(tmp_path / "stage", split="train", return_keys=True,
                                sampling=shards.Sampling(shuffle=False))
    got, want = ({key: image for image, _, key in ds} for ds in (dataset, local))
    assert got.keys() == want.keys() and all(got[k].tobytes() == want[k].tobytes() for k in want)


def test_killed_upload_reruns_without_reuploading_finished_objects(src, bucket, tmp_path, uploads, monkeypatch):
    real = s3_upload.upload_file
    done = []

    def dies_after_two(client, path, bucket_name, key, **kwargs):
        if len(done) == 2:
            raise KeyboardInterrupt  # the job is killed mid-upload
        real(client, path, bucket_name, key, **kwargs)
        done.append(key.rsplit("/", 1)[-1])

    monkeypatch.setattr(s3_upload, "upload_file", dies_after_two)
    first = _pack(src, bucket.url("ds"), tmp_path / "stage")
    assert first.exit_code != 0 and "dataset.json" not in _objects(bucket)
    monkeypatch.undo()
    rerun_uploads: list[str] = []
    monkeypatch.setattr(s3_upload, "upload_file",
                        lambda c, p, b, k, **kw: (real(c, p, b, k, **kw), rerun_uploads.append(k.rsplit("/", 1)[-1])))
    second = _pack(src, bucket.url("ds"), tmp_path / "stage")
    assert second.exit_code == 0, second.output
    assert not set(done) & set(rerun_uploads) and rerun_uploads[-1] == "dataset.json"
    columns = column_files(json.loads((tmp_path / "stage" / "dataset.json").read_text())["columns"])
    assert len(done) + len(rerun_uploads) == 3 + 3 + 2 + len(columns)  # shards, sidecars, index, manifest, columns
    third = _pack(src, bucket.url("ds"), tmp_path / "stage")
    assert json.loads(third.output.strip().splitlines()[-1])["upload"]["uploaded"] == 0


def test_a_prefix_holding_another_dataset_or_foreign_objects_is_refused(src, bucket, tmp_path):
    assert _pack(src, bucket.url("ds"), tmp_path / "stage").exit_code == 0
    other = _pack(src, bucket.url("ds"), tmp_path / "stage2", "--seed", "7")
    assert other.exit_code == 2 and "different dataset.json" in other.output
    replaced = _pack(src, bucket.url("ds"), tmp_path / "stage2", "--seed", "7", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert json.loads(_objects(bucket)["dataset.json"])["packing"]["seed"] == 7
    bucket.put("ds2/notes.txt", b"mine")
    foreign = _pack(src, bucket.url("ds2"), tmp_path / "stage3")
    assert foreign.exit_code == 2 and "did not write" in foreign.output
    assert _pack(src, bucket.url("ds2"), tmp_path / "stage3", "--overwrite").exit_code == 0
    assert bucket.client.get_object(Bucket=bucket.name, Key=f"{bucket.prefix}/ds2/notes.txt")["Body"].read() == b"mine"


def test_several_tasks_need_a_shared_stage_dir(src, bucket):
    result = CliRunner().invoke(pack_shards_command, [str(src), "--out", bucket.url("ds"), "--num-tasks", "2",
                                                      "--task-index", "0"])
    assert result.exit_code == 2 and "--stage-dir" in result.output


def test_precompute_features_to_s3_round_trip(src, bucket, tmp_path):
    from preprocess.features.cli import precompute_features_command
    from preprocess.pack.packer import PackConfig, pack

    data = tmp_path / "data"
    pack(PackConfig(source=str(src), out=str(data), max_samples=5, quiet=True))
    args = [str(data), "--out", bucket.url("feat"), "--stage-dir", str(tmp_path / "fstage"), "--backbone",
            "resnet18", "--weights", "none", "--resize", "40", "--crop", "32", "--batch-size", "4", "--workers",
            "0", "--device", "cpu", "--quiet"]
    result = CliRunner().invoke(precompute_features_command, args)
    assert result.exit_code == 0, result.output
    listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=f"{bucket.prefix}/feat/")
    names = sorted(item["Key"].rsplit("/", 1)[-1] for item in listed["Contents"])
    assert names == ["features.json", "train-000000.pt", "train-000001.pt", "train-000002.pt"]
    for name in names:
        body = bucket.client.get_object(Bucket=bucket.name, Key=f"{bucket.prefix}/feat/{name}")["Body"].read()
        assert body == (tmp_path / "fstage" / name).read_bytes()
    again = CliRunner().invoke(precompute_features_command, args)
    upload = json.loads(again.output.strip().splitlines()[-1])["upload"]
    assert upload["already_complete"] >= 3 and upload["uploaded"] <= 1  # at most a rewritten features.json
