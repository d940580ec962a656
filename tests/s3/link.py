"""A network link model: a threaded HTTP proxy in front of the S3 server that adds a latency to every request and
caps each connection's rate, forwarding bytes unchanged (keep-alive kept, many connections at once), and counts
the requests in flight (the most at once).

A store on another machine answers each request in tens of milliseconds and one connection carries 50-100 MB/s;
on loopback neither holds, so a reader that keeps one request in flight looks fine here and is slow there. Used by
``scripts/bench/s3.py`` (``LinkProxy(upstream, latency_s=0.02, rate=60e6)``, and with the model off as the
baseline through the same proxy) and by the parallel-read tests (how many requests are in flight at once).

Headers pass through unchanged (the Host header included), so SigV4 signatures made for the proxy's address still
verify at the server.
"""

from __future__ import annotations

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}
_CHUNK = 64 << 10


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # many workers' pooled connections opening at once


class LinkProxy:
    """``latency_s`` before each request is forwarded, at most ``rate`` bytes/s of response body per connection
    (0: no cap); ``latency_s=0, rate=0`` is the link model off."""

    def __init__(self, upstream: str, *, latency_s: float = 0.0, rate: float = 0.0):
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.upstream = (host, int(port))
        self.latency_s, self.rate = latency_s, rate
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.body_bytes = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: a client's pooled connection stays one connection here

            def log_message(self, *args) -> None:
                pass

            def _upstream(self) -> http.client.HTTPConnection:
                if getattr(self, "_connection", None) is None:
                    self._connection = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                return self._connection

            def _serve(self) -> None:
                with proxy._lock:
                    proxy.requests += 1
                    proxy.in_flight += 1
                    proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                try:
                    self._forward()
                finally:
                    with proxy._lock:
                        proxy.in_flight -= 1

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if proxy.latency_s:
                    time.sleep(proxy.latency_s)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                try:
                    upstream = self._upstream()
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                except (OSError, http.client.HTTPException):
                    self._connection = None  # a stale kept-alive upstream connection: one fresh try
                    upstream = self._upstream()
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                size = response.getheader("Content-Length")
                payload = None
                if size is None and self.command != "HEAD":
                    payload = response.read()
                    size = str(len(payload))
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in _HOP_BY_HOP and name.lower() not in ("content-length", "date", "server"):
                        self.send_header(name, value)
                if size is not None:
                    self.send_header("Content-Length", size)
                self.end_headers()
                if self.command == "HEAD":
                    response.read()
                    return
                began, sent = time.perf_counter(), 0
                while True:
                    chunk = payload[sent:sent + _CHUNK] if payload is not None else response.read(_CHUNK)
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    sent += len(chunk)
                    if proxy.rate:
                        wait = began + sent / proxy.rate - time.perf_counter()
                        if wait > 0:
                            time.sleep(wait)
                with proxy._lock:
                    proxy.body_bytes += sent
                if response.will_close:
                    self._connection = None

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _serve

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.endpoint_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def set_link(self, latency_s: float, rate: float) -> None:
        """Switch the model (applies to the requests that start after)."""
        self.latency_s, self.rate = latency_s, rate

    def reset_counts(self) -> None:
        with self._lock:
            self.requests = self.max_in_flight = self.body_bytes = 0

    def __enter__(self) -> "LinkProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class _SharedModel(LinkProxy):
    """A ``LinkProxy`` whose model is read, per request and per chunk, from an array another process sets."""

    def __init__(self, upstream: str, model):
        self._model = model
        super().__init__(upstream)

    latency_s = property(lambda self: self._model[0], lambda self, value: None)
    rate = property(lambda self: self._model[1], lambda self, value: None)


def _serve_shared(upstream: str, model, ready) -> None:
    with _SharedModel(upstream, model) as proxy:
        ready.put(proxy.endpoint_url)
        threading.Event().wait()  # until the parent terminates this process


class LinkProcess:
    """The same link model in a process of its own (``set_link`` and ``endpoint_url`` as ``LinkProxy``; no request
    counters). A benchmark uses it so that the proxy's threads take no GIL time from the reader's main process,
    which consumes the batches: on a store that is another machine, the link costs the reader nothing but time."""

    def __init__(self, upstream: str):
        import multiprocessing

        context = multiprocessing.get_context("fork")
        self._model = context.Array("d", 2)
        ready = context.Queue()
        self._process = context.Process(target=_serve_shared, args=(upstream, self._model, ready), daemon=True)
        self._process.start()
        self.endpoint_url = ready.get(timeout=60)
        self.pid = self._process.pid

    def set_link(self, latency_s: float, rate: float) -> None:
        """Switch the model (applies to the requests that start after)."""
        self._model[0], self._model[1] = latency_s, rate

    def __enter__(self) -> "LinkProcess":
        return self

    def __exit__(self, *exc) -> None:
        self._process.terminate()
        self._process.join(10)
