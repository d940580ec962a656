"""``shards verify --workers N`` on ``s3://``: the caller's S3 options reach the worker processes (the endpoint is
given only as an option here, not in the environment), and the report is the one a single process makes."""

from __future__ import annotations

import re

import pytest

from shards.check.verify import verify_dataset
from tests.shards.test_verify_workers import damaged_dataset


@pytest.mark.slow
def test_parallel_verify_on_s3_is_the_serial_report(bucket, s3_env, monkeypatch, tmp_path):
    url = bucket.upload(damaged_dataset(tmp_path / "data"), "data")
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # reachable only through the options passed below
    options = {"endpoint_url": s3_env.endpoint_url}
    serial = verify_dataset(url, full=True, storage_options=options, workers=1, quiet=True)
    assert "train-000003.tar: missing" in serial.problems
    assert "train-000004.tar [sample train_00001]: key also in train-000000.tar" in serial.problems
    parallel = verify_dataset(url, full=True, storage_options=options, workers=2, quiet=True)
    assert _without_copies(parallel.problems) == _without_copies(serial.problems)
    assert (parallel.shards_checked, parallel.samples_read, parallel.samples_decoded) == \
        (serial.shards_checked, serial.samples_read, serial.samples_decoded)


def _without_copies(problems) -> list[str]:
    """Problems with the temporary copy a shard was read from taken out (a new folder on every read)."""
    return [re.sub(r"\S*/shardcache-copy-[^/]+/", "", p) for p in problems]
