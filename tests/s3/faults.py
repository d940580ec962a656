"""A fault-injecting HTTP proxy in front of the S3 server: 503 SlowDown for the first requests, connections reset
in the middle of a response body, and a log of every request (method, path, Range) to count what was fetched.

Headers pass through unchanged (the Host header included), so SigV4 signatures made for the proxy's address still
verify at the server.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


@dataclass
class Faults:
    slow_down_first: int = 0  # answer 503 SlowDown to this many requests first
    reset_requests: set[int] = field(default_factory=set)  # request numbers (0-based) whose body breaks...
    reset_after_bytes: int = 1000  # ...after this many body bytes
    reset_once_suffix: str | None = None  # also break the first response of every object whose path ends so


class FaultProxy:
    def __init__(self, upstream: str, faults: Faults | None = None):
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.faults = faults or Faults()
        self.requests: list[tuple[str, str, str | None, int]] = []  # (method, path, Range, status)
        self.body_bytes = 0
        self.resets: list[int] = []  # numbers of the requests whose body was cut
        self._reset_paths: set[str] = set()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy._lock:
                    number = len(proxy.requests)
                    slow = number < proxy.faults.slow_down_first
                    proxy.requests.append((self.command, self.path, self.headers.get("Range"), 503 if slow else 0))
                if slow:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(SLOW_DOWN if self.command != "HEAD" else b"")
                    self.close_connection = True
                    return
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    upstream.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    response = upstream.getresponse()
                    payload = response.read()
                finally:
                    upstream.close()
                with proxy._lock:
                    proxy.requests[number] = (*proxy.requests[number][:3], response.status)
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("connection", "transfer-encoding", "date", "server"):
                        self.send_header(name, value)
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command == "HEAD":
                    return
                suffix = proxy.faults.reset_once_suffix
                once = (suffix is not None and self.path.endswith(suffix) and self.path not in proxy._reset_paths)
                if (number in proxy.faults.reset_requests or once) and len(payload) > proxy.faults.reset_after_bytes:
                    proxy._reset_paths.add(self.path)
                    self.wfile.write(payload[:proxy.faults.reset_after_bytes])
                    self.wfile.flush()
                    with proxy._lock:
                        proxy.body_bytes += proxy.faults.reset_after_bytes
                        proxy.resets.append(number)
                    # SO_LINGER 0: close with a TCP reset, as a dying load balancer does.
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                self.wfile.write(payload)
                with proxy._lock:
                    proxy.body_bytes += len(payload)
                self.close_connection = True

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _serve

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self) -> list[tuple[str, str, str | None, int]]:
        return [r for r in self.requests if r[0] == "GET"]
