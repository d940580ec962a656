"""Round three on the network: a server that answers a byte at a time (slowloris) is cut off by the transfer limits
(a minimum rate over a window of waiting, a deadline per request), for ``http(s)://`` and ``s3://`` alike, with
one ``CorruptDataError`` naming the URL, in seconds rather than hours. A socket timeout alone never fires against
such a server: every wait for the next byte is short.

The servers here are raw sockets on loopback, so that the status line, the headers or the body can each be
dribbled; a healthy read of the same objects is unchanged.
"""

from __future__ import annotations

import socketserver
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from click.testing import CliRunner

from shards.cli.main import main as shards_cli
from shards.errors import CorruptDataError, InputError
from shards.transport.location import locate
from shards.transport.s3 import S3Options

DRIBBLE_S = 0.2  # one byte every 0.2 s: 5 bytes/s, far under any minimum rate
BODY = 100_000
FAST = {"min_transfer_rate": 1024, "rate_window_s": 1.0}  # a window short enough for a test
CUT_OFF_WITHIN_S = 8.0


class Dribbler(socketserver.ThreadingTCPServer):
    """A loopback HTTP server whose answers come slowly: ``mode`` says which part is dribbled."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, mode: str, chunk: int = 1):
        self.mode, self.chunk = mode, chunk
        self.stop = threading.Event()
        super().__init__(("127.0.0.1", 0), DribbleHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def dribble(self, socket_file, data: bytes) -> None:
        for at in range(0, len(data), self.chunk):
            if self.stop.wait(DRIBBLE_S):
                return
            socket_file.write(data[at:at + self.chunk])
            socket_file.flush()


class DribbleHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        server: Dribbler = self.server  # type: ignore[assignment]
        request = b""
        while not request.endswith(b"\r\n\r\n"):
            line = self.rfile.readline()
            if not line:
                return
            request += line
        head, ranged = request.split(b"\r\n", 1)[0], b"\nrange:" in request.lower()
        try:
            if server.mode == "status":
                server.dribble(self.wfile, b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"a" * BODY)
                return
            if server.mode == "headers":
                self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                server.dribble(self.wfile, b"X-Slow: " + b"a" * BODY)
                return
            status = b"206 Partial Content" if ranged else b"200 OK"
            extra = b"Content-Range: bytes 0-%d/%d\r\n" % (BODY - 1, BODY) if ranged else b""
            self.wfile.write(b"HTTP/1.1 " + status + b"\r\nAccept-Ranges: bytes\r\nContent-Length: %d\r\n" % BODY
                             + extra + b"Connection: close\r\n\r\n")
            self.wfile.flush()
            if not head.startswith(b"HEAD"):
                server.dribble(self.wfile, b"x" * BODY)
        except OSError:
            pass  # the client cut the connection off: what the tests want


@contextmanager
def dribbler(mode: str, chunk: int = 1) -> Iterator[Dribbler]:
    server = Dribbler(mode, chunk)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()


def outcome_within(seconds: float, read) -> tuple[BaseException | None, float]:
    """Run ``read`` on a thread: what it raised and how long it took; fails when it is still reading after
    ``seconds`` (before the limits existed, these reads would take hours)."""
    result: list = []

    def run() -> None:
        began = time.monotonic()
        try:
            read()
            result.append((None, time.monotonic() - began))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.append((exc, time.monotonic() - began))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert result, f"still reading after {seconds} s: the slow server was not cut off"
    return result[0]


def assert_cut_off(error: BaseException | None, url: str, words: str) -> None:
    assert isinstance(error, CorruptDataError), repr(error)
    assert url in str(error) and words in str(error), str(error)


# -- http(s) ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["body", "ranged"])
@pytest.mark.slow
def test_a_dribbled_http_body_is_cut_off_by_the_minimum_rate(mode):
    with dribbler(mode) as server:
        url = server.url + "/dataset.json"
        location = locate(url, storage_options=FAST)
        error, took = outcome_within(CUT_OFF_WITHIN_S, location.read_capped)
    assert_cut_off(error, url, "min_transfer_rate")
    assert took < 4


@pytest.mark.slow
def test_a_dribbled_http_stream_is_cut_off(tmp_path):
    with dribbler("body") as server:
        url = server.url + "/train-000000.tar"
        location = locate(url, storage_options=FAST)

        def read_stream() -> None:
            with location.open_stream() as stream:
                while stream.read(1 << 16):
                    pass

        error, took = outcome_within(CUT_OFF_WITHIN_S, read_stream)
    assert_cut_off(error, url, "slower than the minimum")


@pytest.mark.parametrize("mode", ["status", "headers"])
@pytest.mark.slow
def test_dribbled_status_line_or_headers_are_cut_off(mode):
    with dribbler(mode) as server:
        url = server.url + "/dataset.json"
        error, took = outcome_within(CUT_OFF_WITHIN_S, locate(url, storage_options=FAST).read_capped)
    assert_cut_off(error, url, "no complete status line and headers within 1 s")
    assert took < 4


@pytest.mark.slow
def test_a_server_above_the_rate_is_still_cut_off_by_the_request_deadline():
    with dribbler("body", chunk=400) as server:  # 2,000 bytes/s: above the 1 KiB/s minimum
        url = server.url + "/dataset.json"
        location = locate(url, storage_options={**FAST, "request_deadline_s": 2})
        error, took = outcome_within(CUT_OFF_WITHIN_S, location.read_capped)
    assert_cut_off(error, url, "more than 2 s")
    assert 1.5 < took < 5


@pytest.mark.slow
def test_the_command_line_sets_the_limits(tmp_path):
    with dribbler("body") as server:
        runner = CliRunner()
        result: list = []

        def inspect() -> None:
            result.append(runner.invoke(shards_cli, ["inspect", server.url + "/ds", "--request-deadline", "1.5",
                                                     "--min-transfer-rate", "1K"]))

        error, took = outcome_within(CUT_OFF_WITHIN_S, inspect)
    assert error is None and result[0].exit_code == 1, result[0].output
    assert server.url + "/ds/dataset.json" in result[0].output and "1.5 s" in result[0].output


def test_limits_are_checked_options():
    assert S3Options(min_transfer_rate="2K").transfer_limits().min_rate == 2048
    assert S3Options().transfer_limits().deadline_s > S3Options().transfer_limits().window_s
    for bad in ({"min_transfer_rate": -1}, {"rate_window_s": 0}, {"request_deadline_s": float("inf")},
                {"request_deadline_s": True}):
        with pytest.raises(InputError):
            S3Options(**bad)


# -- s3 ----------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_dribbled_s3_body_is_cut_off_by_the_minimum_rate():
    pytest.importorskip("botocore")
    with dribbler("ranged") as server:
        url = "s3://bucket/train-000000.tar"
        options = S3Options(endpoint_url=server.url, unsigned=True, region="us-east-1", max_attempts=2, **FAST)
        location = locate(url, storage_options=options)
        error, took = outcome_within(CUT_OFF_WITHIN_S, lambda: location.fetch_checked(BODY, None))
    assert_cut_off(error, url, "min_transfer_rate")
    assert took < 4
