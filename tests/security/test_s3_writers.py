"""Writers that race on one ``s3://`` prefix: the writers' lease (``shards.publish.s3_lease``) lets one publish and
refuses the other in one line (exit 2), a stale lease is taken over, ``--break-lease`` takes a live one, a writer
that lost its lease never publishes its manifest, the manifest is written only over the one the writer read, and a
rerun aborts the unfinished multipart uploads of its own keys. Real SeaweedFS, real processes where it matters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import shards.publish.s3_upload as s3_upload
from preprocess.pack.cli import pack_shards_command
from preprocess.pack.packer import PackConfig, pack
from preprocess.pack.parts import dataset_spec
from shards.cli.main import main as shards_cli
from shards.errors import CorruptDataError
from shards.transport.s3 import S3PreconditionFailed, make_client
from shards.publish.s3_lease import LEASE_NAME, Lease, LeaseHeldError, LeaseLostError, acquire_lease, read_lease
from tests.helpers import write_image_folder
from tests.s3.conftest import Bucket, s3_env, s3_server  # noqa: F401 (the s3 tests' server, here too)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
# pack-shards in a child process whose uploads wait for the file GATE: a winner holds the lease, uploading nothing,
# until the test opens the gate.
GATED_PACK = """
import os, sys, time
sys.path.insert(0, {root!r})
import shards.publish.s3_upload as s3_upload
real = s3_upload.upload_file
def gated(*args, **kwargs):
    while not os.path.exists({gate!r}):
        time.sleep(0.05)
    return real(*args, **kwargs)
s3_upload.upload_file = gated
from preprocess.pack.cli import pack_shards_command
pack_shards_command()
"""
GHOST = {"user": "ghost", "host": "node7", "pid": 4242, "token": "0badc0de0badc0de", "since": "2026-01-01T00:00:00Z"}


@pytest.fixture
def bucket(s3_env):  # noqa: F811
    return Bucket(s3_env, f"w{os.getpid()}-{time.monotonic_ns()}")


@pytest.fixture
def src(tmp_path) -> Path:
    return write_image_folder(tmp_path / "src", ["a", "b"], per_class=6)


def _pack(src: Path, url: str, stage: Path, *extra: str):
    return CliRunner().invoke(pack_shards_command, [str(src), "--out", url, "--stage-dir", str(stage),
                                                   "--shard-samples", "5", "--quiet", *extra])


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def put_lease(bucket, name: str, ttl_s: float) -> None:
    bucket.put(f"{name}/{LEASE_NAME}", json.dumps({"holder": GHOST, "ttl_s": ttl_s}).encode())


def keys(bucket, name: str) -> set[str]:
    listed = bucket.client.list_objects_v2(Bucket=bucket.name, Prefix=f"{bucket.prefix}/{name}/")
    return {item["Key"].rsplit("/", 1)[-1] for item in listed.get("Contents", [])}


def remote_bytes(bucket, key: str) -> bytes:
    return bucket.client.get_object(Bucket=bucket.name, Key=f"{bucket.prefix}/{key}")["Body"].read()


def verify(url: str) -> None:
    result = CliRunner().invoke(shards_cli, ["verify", url, "--full", "--quiet"])
    assert result.exit_code == 0, result.output


# -- two writers ------------------------------------------------------------------------------------------------------
@pytest.mark.s3
@pytest.mark.slow
def test_two_pack_shards_racing_to_one_prefix_one_publishes_the_other_exits_2_naming_it(bucket, tmp_path):
    url, gate = bucket.url("ds"), tmp_path / "gate"
    sources = [write_image_folder(tmp_path / f"src{i}", ["a", "b"], per_class=5 + 3 * i) for i in range(2)]
    runs = [subprocess.Popen([sys.executable, "-c", GATED_PACK.format(root=str(ROOT), gate=str(gate)), str(source),
                              "--out", url, "--stage-dir", str(tmp_path / f"stage{i}"), "--shard-samples", "3",
                              "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i, source in enumerate(sources)]
    deadline = time.monotonic() + TIMEOUT_S
    while all(run.poll() is None for run in runs) and time.monotonic() < deadline:
        time.sleep(0.1)  # the winner holds the lease at the gate; the loser is refused meanwhile
    gate.touch()
    outputs = [run.communicate(timeout=TIMEOUT_S) for run in runs]
    codes = [run.returncode for run in runs]
    assert sorted(codes) == [0, 2], outputs
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    stderr = outputs[loser][1]
    lines = error_lines(stderr)
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert url in lines[0] and "another process is writing here" in lines[0]
    assert f"pid {runs[winner].pid}" in lines[0] and "--break-lease" in lines[0]
    published = remote_bytes(bucket, "ds/dataset.json")
    assert published == (tmp_path / f"stage{winner}" / "dataset.json").read_bytes()
    assert LEASE_NAME not in keys(bucket, "ds")  # released
    verify(url)


@pytest.mark.s3
@pytest.mark.slow
def test_of_concurrent_takers_exactly_one_gets_the_lease(bucket):
    client, url = make_client(), bucket.url("ds")
    takers = 6
    barrier, outcomes = threading.Barrier(takers), []

    def take() -> None:
        barrier.wait()
        try:
            outcomes.append(acquire_lease(client, url, what="test"))
        except LeaseHeldError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=take) for _ in range(takers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    leases = [outcome for outcome in outcomes if isinstance(outcome, Lease)]
    assert len(outcomes) == takers and len(leases) == 1
    assert all("another process is writing here" in str(o) for o in outcomes if not isinstance(o, Lease))
    leases[0].release()
    assert read_lease(client, url) is None


# -- stale and live leases --------------------------------------------------------------------------------------------
@pytest.mark.s3
@pytest.mark.slow
def test_a_live_lease_refuses_before_any_local_work_and_break_lease_takes_it_over(src, bucket, tmp_path):
    put_lease(bucket, "ds", ttl_s=600)
    refused = _pack(src, bucket.url("ds"), tmp_path / "stage")
    assert refused.exit_code == 2
    lines = error_lines(refused.output)
    assert len(lines) == 1 and "user ghost, host node7, pid 4242" in lines[0] and "--break-lease" in lines[0]
    assert "expires" in lines[0] and bucket.url("ds") in lines[0]
    assert not (tmp_path / "stage" / "dataset.json").exists() and keys(bucket, "ds") == {LEASE_NAME}

    taken = _pack(src, bucket.url("ds"), tmp_path / "stage", "--break-lease")
    assert taken.exit_code == 0, taken.output
    assert "dataset.json" in keys(bucket, "ds") and LEASE_NAME not in keys(bucket, "ds")
    verify(bucket.url("ds"))


@pytest.mark.s3
@pytest.mark.slow
def test_a_lease_whose_holder_stopped_renewing_is_taken_over_once_expired(src, bucket, tmp_path):
    put_lease(bucket, "ds", ttl_s=0.001)
    time.sleep(1.1)  # the server's clock counts whole seconds
    result = _pack(src, bucket.url("ds"), tmp_path / "stage")
    assert result.exit_code == 0, result.output
    assert LEASE_NAME not in keys(bucket, "ds")
    verify(bucket.url("ds"))


@pytest.mark.s3
@pytest.mark.slow
def test_a_renewed_lease_outlives_its_ttl_and_notices_when_it_is_taken(bucket):
    client, url = make_client(), bucket.url("ds")
    lease = acquire_lease(client, url, what="first", ttl_s=1.5)  # renewed every 0.5 s by its thread
    time.sleep(3.2)
    with pytest.raises(LeaseHeldError, match="another process is writing here"):
        acquire_lease(client, url, what="second")
    other = acquire_lease(client, url, what="second", break_lease=True)
    deadline = time.monotonic() + 10
    while lease.lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(LeaseLostError, match="taken over"):
        lease.check()  # found by the renewal thread, without a request from the publisher
    lease.release()  # never deletes its successor's lease
    assert read_lease(client, url).holder["token"] == other.holder["token"]
    other.release()
    assert read_lease(client, url) is None


@pytest.mark.s3
@pytest.mark.slow
def test_a_writer_whose_lease_is_broken_mid_run_fails_without_publishing_its_manifest(src, bucket, tmp_path,
                                                                                       monkeypatch):
    stage = tmp_path / "stage"
    pack(PackConfig(source=str(src), out=str(stage), max_samples=5, quiet=True))
    url, client = bucket.url("ds"), make_client()
    first_done, resume, errors = threading.Event(), threading.Event(), []
    real = s3_upload.upload_file

    def stalls_after_one(*args, **kwargs):
        real(*args, **kwargs)
        if not first_done.is_set():
            first_done.set()
            assert resume.wait(TIMEOUT_S)

    monkeypatch.setattr(s3_upload, "upload_file", stalls_after_one)

    def publish() -> None:
        try:
            s3_upload.publish_folder(stage, url, dataset_spec())
        except Exception as exc:  # noqa: BLE001 (the test inspects it below)
            errors.append(exc)

    writer = threading.Thread(target=publish)
    writer.start()
    assert first_done.wait(TIMEOUT_S)
    breaker = acquire_lease(client, url, what="breaker", break_lease=True)
    resume.set()
    writer.join(TIMEOUT_S)
    assert len(errors) == 1 and isinstance(errors[0], LeaseLostError), errors
    assert "taken over" in str(errors[0]) and "\n" not in str(errors[0])
    assert "dataset.json" not in keys(bucket, "ds")
    assert read_lease(client, url).holder["token"] == breaker.holder["token"]
    breaker.release()


@pytest.mark.s3
@pytest.mark.slow
def test_after_a_takeover_an_object_the_old_holder_overwrote_late_stops_the_publish(src, bucket, tmp_path,
                                                                                    monkeypatch):
    stage, url = tmp_path / "stage", bucket.url("ds")
    pack(PackConfig(source=str(src), out=str(stage), max_samples=5, quiet=True))
    put_lease(bucket, "ds", ttl_s=600)
    real, uploaded = s3_upload.upload_file, []

    def old_holder_lands_late(client, path, bucket_name, key, **kwargs):
        real(client, path, bucket_name, key, **kwargs)
        uploaded.append(key)
        if len(uploaded) == 1:  # the broken holder's PUT of the same name, in flight when its lease was taken
            bucket.client.put_object(Bucket=bucket.name, Key=key, Body=b"the old holder's shard",
                                     Metadata={"sha256": "0" * 64})

    monkeypatch.setattr(s3_upload, "upload_file", old_holder_lands_late)
    with pytest.raises(CorruptDataError, match="still writing"):
        s3_upload.publish_folder(stage, url, dataset_spec(), break_lease=True)
    assert "dataset.json" not in keys(bucket, "ds") and LEASE_NAME not in keys(bucket, "ds")
    monkeypatch.setattr(s3_upload, "upload_file", real)  # not undo(): that would also drop s3_env's environment
    again = s3_upload.publish_folder(stage, url, dataset_spec())  # the rerun uploads the overwritten object again
    assert again.uploaded[0] == uploaded[0].rsplit("/", 1)[-1] and again.uploaded[-1] == "dataset.json"
    verify(url)


# -- the manifest is written over what the writer read, and only that -------------------------------------------------
@pytest.mark.s3
@pytest.mark.slow
@pytest.mark.parametrize("republish", [False, True], ids=["fresh", "republish"])
def test_a_manifest_published_meanwhile_by_a_writer_ignoring_leases_is_never_replaced(src, bucket, tmp_path,
                                                                                       monkeypatch, republish):
    stage, url = tmp_path / "stage", bucket.url("ds")
    pack(PackConfig(source=str(src), out=str(stage), max_samples=5, quiet=True))
    if republish:  # the same dataset is there; the new manifest differs in bytes only, so it is rewritten
        s3_upload.publish_folder(stage, url, dataset_spec())
        manifest = json.loads((stage / "dataset.json").read_text())
        (stage / "dataset.json").write_text(json.dumps({**manifest, "created": "2027-01-01T00:00:00Z"}))
    rogue = b'{"written": "by a writer that takes no lease"}'
    real = s3_upload.upload_file

    def rogue_first(client, path, bucket_name, key, **kwargs):
        if key.endswith("/dataset.json"):
            bucket.put("ds/dataset.json", rogue)
        real(client, path, bucket_name, key, **kwargs)

    monkeypatch.setattr(s3_upload, "upload_file", rogue_first)
    with pytest.raises(S3PreconditionFailed, match="another writer published here"):
        s3_upload.publish_folder(stage, url, dataset_spec())
    assert remote_bytes(bucket, "ds/dataset.json") == rogue
    assert LEASE_NAME not in keys(bucket, "ds")


# -- unfinished multipart uploads -------------------------------------------------------------------------------------
@pytest.mark.s3
@pytest.mark.slow
def test_a_rerun_aborts_the_unfinished_multipart_uploads_of_its_own_keys_only(src, bucket, tmp_path):
    client = bucket.client
    orphans = {}
    for name in ("ds/train-000000.tar", "ds/notes.bin", "other/train-000000.tar"):
        key = f"{bucket.prefix}/{name}"
        upload_id = client.create_multipart_upload(Bucket=bucket.name, Key=key)["UploadId"]
        client.upload_part(Bucket=bucket.name, Key=key, UploadId=upload_id, PartNumber=1, Body=b"x" * (5 << 20))
        orphans[name] = upload_id
    result = _pack(src, bucket.url("ds"), tmp_path / "stage")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["upload"]["aborted_multipart"] == 1
    left = client.list_multipart_uploads(Bucket=bucket.name, Prefix=f"{bucket.prefix}/").get("Uploads", [])
    assert {(u["Key"][len(bucket.prefix) + 1:], u["UploadId"]) for u in left} == {
        (name, orphans[name]) for name in ("ds/notes.bin", "other/train-000000.tar")}
    verify(bucket.url("ds"))
    for name in ("ds/notes.bin", "other/train-000000.tar"):
        client.abort_multipart_upload(Bucket=bucket.name, Key=f"{bucket.prefix}/{name}", UploadId=orphans[name])


# -- the option -------------------------------------------------------------------------------------------------------
def test_break_lease_is_refused_for_a_local_out(src, tmp_path):
    result = CliRunner().invoke(pack_shards_command, [str(src), "--out", str(tmp_path / "out"), "--break-lease"])
    assert result.exit_code == 2 and "--break-lease works only with --out s3://" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.s3
@pytest.mark.slow
def test_precompute_features_to_s3_is_refused_while_another_writer_holds_the_prefix(src, bucket, tmp_path):
    from preprocess.features.cli import precompute_features_command

    data = tmp_path / "data"
    pack(PackConfig(source=str(src), out=str(data), max_samples=5, quiet=True))
    put_lease(bucket, "feat", ttl_s=600)
    result = CliRunner().invoke(precompute_features_command, [
        str(data), "--out", bucket.url("feat"), "--stage-dir", str(tmp_path / "fstage"), "--backbone", "resnet18",
        "--weights", "none", "--resize", "40", "--crop", "32", "--batch-size", "4", "--workers", "0", "--device",
        "cpu", "--quiet"])
    assert result.exit_code == 2
    lines = error_lines(result.output)
    assert len(lines) == 1 and "pid 4242" in lines[0] and "--break-lease" in lines[0]
    assert not list((tmp_path / "fstage").glob("*.pt")) and keys(bucket, "feat") == {LEASE_NAME}
