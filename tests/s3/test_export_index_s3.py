"""``shards export-index`` of a dataset on ``s3://``: the manifest read there, the index written here with the
shards' ``s3://`` urls, and wids (its ``s3`` download command swapped for a boto3 GET to the test server) reads
the same samples as from the local folder."""

from __future__ import annotations

import json

import pytest
import wids
import wids.wids_dl
from click.testing import CliRunner

from shards.cli.main import main as shards_main
from tests.helpers import make_shard_dataset
from tests.shards.test_export_index import ours, through_wids

pytestmark = [pytest.mark.s3, pytest.mark.slow]  # slow: starting and stopping SeaweedFS takes seconds


def test_an_s3_dataset_exports_its_s3_urls_and_wids_reads_them(bucket, tmp_path, monkeypatch):
    local = tmp_path / "ds"
    make_shard_dataset(local, shard_sizes={"train": [3, 4]}, size=(8, 8))
    url = bucket.upload(local, "data")

    def s3_get(remote: str, target: str) -> None:
        key = remote.removeprefix(f"s3://{bucket.name}/")
        with open(target, "wb") as handle:
            handle.write(bucket.client.get_object(Bucket=bucket.name, Key=key)["Body"].read())

    monkeypatch.setitem(wids.wids_dl.default_cmds, "s3", s3_get)
    index = tmp_path / "here" / "train.json"
    result = CliRunner().invoke(shards_main, ["export-index", url, "--out", str(index)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["relative_urls"] is False
    urls = [s["url"] for s in json.loads(index.read_text())["shardlist"]]
    assert urls == [f"{url}/train-00000{i}.tar" for i in range(2)]
    assert through_wids(index, tmp_path / "cache") == ours(local, "train")
