"""The ``s3`` tests' server: one SeaweedFS (``weed mini``) per session on free ports, stopped afterwards (also when
tests fail). When it cannot start, the tests skip with the reason, or fail under CI (``SHARDCACHE_REQUIRE_S3=1``).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from tests.s3.server import ACCESS_KEY, SECRET_KEY, start_server

_prefixes = itertools.count()
_running: list = []  # the one server of this test process, also for modules elsewhere that import these fixtures


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    if _running:
        yield _running[0]
        return
    try:
        import boto3  # noqa: F401

        server = start_server(tmp_path_factory.mktemp("seaweedfs"))
    except (ImportError, RuntimeError, OSError) as exc:
        reason = f"no local S3 server: {str(exc).splitlines()[0]}"
        if os.environ.get("SHARDCACHE_REQUIRE_S3") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    _running.append(server)
    try:
        yield server
    finally:
        _running.clear()
        server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch, tmp_path):
    """The standard AWS chain pointed at the test server (and away from any real ~/.aws)."""
    from shards.transport import s3

    for name, value in {**s3_server.client_env(), "AWS_CONFIG_FILE": str(tmp_path / "aws-config"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "aws-credentials")}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(s3, "BACKOFF_BASE_S", 0.01)
    s3.forget_clients()
    s3.FETCH_STATS.reset()
    yield s3_server
    s3.forget_clients()


class Bucket:
    """The session's bucket with a fresh prefix per test; ``upload`` copies a local folder under it."""

    def __init__(self, server, prefix: str):
        import boto3

        self.name = server.bucket
        self.prefix = prefix
        self.client = boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id=ACCESS_KEY,
                                   aws_secret_access_key=SECRET_KEY, region_name="us-east-1")

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.name}/{self.prefix}", *parts])

    def upload(self, folder: Path, name: str, skip=lambda path: False) -> str:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not skip(path):
                key = f"{self.prefix}/{name}/{path.relative_to(folder).as_posix()}"
                self.client.put_object(Bucket=self.name, Key=key, Body=path.read_bytes())
        return self.url(name)

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket=self.name, Key=f"{self.prefix}/{key}", Body=data)
        return self.url(key)


@pytest.fixture
def bucket(s3_env):
    return Bucket(s3_env, f"t{os.getpid()}-{next(_prefixes)}")
