"""Parallel ranged reads (``shards.transport.parallel_parts``, ``s3_parallel``, ``remote.open_whole``) against a real
local S3 server and a local http.server: parts reassemble byte-exact, faults resume per part, refusals stay typed,
at most ``max_concurrency`` requests in flight, ranges read ahead are taken (never fetched twice), a stream closed
early stops fetching, a forked process gets its own pool, and a server without ranges is read as one stream."""

from __future__ import annotations

import multiprocessing
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import shards
from shards.errors import ChecksumError, CorruptDataError, MissingInputError
from shards.transport import parallel_parts
from shards.transport import s3
from shards.transport.location import locate
from shards.transport.parallel_parts import READ_AHEAD, drop_read_ahead, pool_for
from shards.transport.s3_parallel import open_parts, read_ahead
from shards.formats.tarindex import read_index
from tests.s3.faults import FaultProxy, Faults
from tests.s3.link import LinkProxy
from tests.s3.test_read import packed

pytestmark = pytest.mark.s3
SIZE = 10_007  # not a multiple of the part size: the last part is short


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(parallel_parts, "PART", 1000)
    monkeypatch.setattr(parallel_parts, "FIRST_PART", 700)
    drop_read_ahead()
    yield
    drop_read_ahead()


def payload(size: int = SIZE, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def read_all(stream, step: int = 333) -> bytes:
    chunks = []
    while chunk := stream.read(step):
        chunks.append(chunk)
    return b"".join(chunks)


def test_parts_reassemble_byte_exact(bucket, small_parts):
    data = payload()
    url = bucket.put("blob", data)
    options = s3.S3Options(max_concurrency=3)
    for start, stop in ((0, SIZE), (123, 4567), (5, 5), (7, 8), (SIZE - 1, SIZE), (999, 2001)):
        s3.FETCH_STATS.reset()
        with open_parts(url, start, stop, options) as stream:
            assert read_all(stream) == data[start:stop]
        assert s3.FETCH_STATS.bytes == stop - start
        assert s3.FETCH_STATS.requests == -(-(stop - start) // 1000)  # one GET per part, none for an empty range
    s3.FETCH_STATS.reset()
    with locate(url, storage_options=options).open() as stream:  # a whole object: 700 bytes, then parts of 1000
        assert stream.read() == data
    assert s3.FETCH_STATS.bytes == SIZE and s3.FETCH_STATS.requests == 1 + -(-(SIZE - 700) // 1000)
    s3.FETCH_STATS.reset()
    assert locate(url, storage_options=options).fetch_checked(SIZE, None) == data  # size known: parts at once
    assert s3.FETCH_STATS.bytes == SIZE and s3.FETCH_STATS.requests == -(-SIZE // 1000)
    with pytest.raises(ChecksumError, match="10007 bytes, the manifest records 10002"):
        locate(url, storage_options=options).fetch_checked(SIZE - 5, None)
    with pytest.raises(ChecksumError, match="10007 bytes, the manifest records 10012"):
        locate(url, storage_options=options).check(SIZE + 5, None)
    for size in (0, 1, 700, 701):  # empty, tiny, exactly the first request, one byte more
        small = bucket.put(f"small-{size}", data[:size])
        assert locate(small, storage_options=options).fetch_checked(size, None) == data[:size]


def test_a_part_broken_mid_body_resumes_and_refusals_are_typed(bucket, small_parts, s3_env):
    data = payload()
    url = bucket.put("blob", data)
    with FaultProxy(s3_env.endpoint_url, Faults(reset_requests={0, 2, 3}, reset_after_bytes=300)) as proxy:
        options = s3.S3Options(endpoint_url=proxy.endpoint_url, max_concurrency=4)
        with open_parts(url, 0, SIZE, options) as stream:
            assert stream.read() == data
        assert len(proxy.resets) == 3
    options = s3.S3Options(max_concurrency=4)
    with pytest.raises(MissingInputError, match="404") as failure:
        with open_parts(bucket.url("gone"), 0, 5000, options) as stream:
            stream.read()
    assert bucket.url("gone") in str(failure.value)
    with open_parts(url, 0, SIZE + 5000, options) as stream:  # the parts past the object's end fail...
        assert b"".join(stream.read(1000) for _ in range(10)) == data[:10_000]  # ...when the reader gets there
        with pytest.raises(CorruptDataError, match="expected at least") as failure:
            stream.read(1000)
    assert url in str(failure.value)


def test_wrong_keys_are_a_typed_403_from_the_part_that_meets_them(bucket, small_parts, monkeypatch):
    url = bucket.put("blob", payload())
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-key")
    s3.forget_clients()
    with pytest.raises(s3.S3AccessDenied, match="403"):
        with open_parts(url, 0, SIZE, s3.S3Options(max_concurrency=2)) as stream:
            stream.read()


def test_at_most_max_concurrency_requests_in_flight(bucket, small_parts, s3_env):
    data = payload(20_000)
    url = bucket.put("blob", data)
    with LinkProxy(s3_env.endpoint_url, latency_s=0.05) as link:
        options = s3.S3Options(endpoint_url=link.endpoint_url, max_concurrency=3)
        with open_parts(url, 0, len(data), options) as stream:
            assert stream.read() == data
        assert link.requests == 20 and link.max_in_flight == 3
        # two streams in one process share the pool: still 3
        link.reset_counts()
        streams = [open_parts(url, 0, 10_000, options), open_parts(url, 10_000, 20_000, options)]
        assert b"".join(s.read() for s in streams) == data
        assert link.max_in_flight == 3


def test_a_stream_closed_early_stops_fetching(bucket, small_parts, s3_env):
    data = payload(40_000)
    url = bucket.put("blob", data)
    with LinkProxy(s3_env.endpoint_url, latency_s=0.05) as link:
        options = s3.S3Options(endpoint_url=link.endpoint_url, max_concurrency=2)
        s3.FETCH_STATS.reset()
        with open_parts(url, 0, len(data), options) as stream:
            assert stream.read(10) == data[:10]
        time.sleep(0.3)
        assert link.requests <= 3  # the parts running when it closed (at most 2, plus the next one submitted)
        assert s3.FETCH_STATS.requests == link.requests


def test_read_ahead_is_taken_not_fetched_twice(bucket, small_parts):
    data = payload()
    url = bucket.put("blob", data)
    options = s3.S3Options(max_concurrency=2, read_ahead_bytes=8000)
    s3.FETCH_STATS.reset()
    assert read_ahead(url, 0, 4000, options) and read_ahead(url, 4000, 8000, options)
    assert not read_ahead(url, 8000, SIZE, options)  # over the budget: not started
    assert READ_AHEAD.held_bytes() == 8000
    with open_parts(url, 0, 4000, options) as first, open_parts(url, 4000, 8000, options) as second:
        assert first.read() + second.read() == data[:8000]
    assert s3.FETCH_STATS.bytes == 8000 and s3.FETCH_STATS.requests == 8
    assert READ_AHEAD.held_bytes() == 0
    assert not read_ahead(url, 0, 10, s3.S3Options(read_ahead_bytes=0))  # 0: no read-ahead at all
    # a range read ahead but passed over is dropped when a later one is taken
    assert read_ahead(url, 0, 1000, options) and read_ahead(url, 1000, 2000, options)
    with open_parts(url, 1000, 2000, options) as stream:
        assert stream.read() == data[1000:2000]
    assert READ_AHEAD.held_bytes() == 0


@pytest.mark.slow
def test_an_epoch_reads_ahead_only_the_samples_bytes(bucket, tmp_path, s3_env):
    local = packed(tmp_path / "data")
    url = bucket.upload(local, "data")

    def epoch(path, **remote):
        dataset = shards.open_dataset(path, "train", seed=5, return_keys=True, remote=shards.Remote(**remote),
                                      decode=shards.Decode(decoder=lambda sample, seed: sample.data),
                                      distributed=shards.Distributed(rank=0, world_size=1))
        return dataset, [(key, data) for data, _, key in dataset]

    dataset, expected = epoch(local)
    with LinkProxy(s3_env.endpoint_url, latency_s=0.05) as link:
        s3.FETCH_STATS.reset()
        _, got = epoch(url, storage_options={"endpoint_url": link.endpoint_url, "max_concurrency": 4})
        assert got == expected
        # Every slice here is one part: requests of two slices at once mean the next one was read ahead.
        assert link.max_in_flight >= 2
    drop_read_ahead()
    index_bytes, sample_bytes = (local / "dataset.json").stat().st_size, 0  # the manifest and the indexes
    for info in dataset.split_info.shards:
        index = (local / info.index).read_bytes()
        offsets = read_index(index, info.path, info.samples, info.bytes)
        index_bytes += len(index)
        sample_bytes += int(offsets[-1] - offsets[0])
    assert s3.FETCH_STATS.bytes == index_bytes + sample_bytes  # each sample's bytes once


def _child(url: str, expected: bytes, parent_pool, queue) -> None:
    try:
        pool = pool_for(2)
        with open_parts(url, 0, len(expected), s3.S3Options(max_concurrency=2)) as stream:
            same = stream.read() == expected
        queue.put((same, pool is not parent_pool, len(pool._threads)))
    except Exception as exc:  # noqa: BLE001 (reported to the parent)
        queue.put(repr(exc))


def test_a_forked_process_gets_its_own_pool(bucket, small_parts):
    data = payload()
    url = bucket.put("blob", data)
    with open_parts(url, 0, SIZE, s3.S3Options(max_concurrency=2)) as stream:
        assert stream.read() == data  # the parent's pool has its threads now
    parent_pool = pool_for(2)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(url, data, parent_pool, queue))
    child.start()
    result = queue.get(timeout=60)
    child.join(30)
    assert result == (True, True, 2)


class _Files(BaseHTTPRequestHandler):
    """Serves ``files`` (path -> bytes); with ``ranges``, says ``Accept-Ranges: bytes`` and answers
    ``Range: bytes=a-b`` with 206. ``seen``: (path, Range) of every GET."""

    files: dict = {}
    ranges = True
    seen: list = []

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes | None:
        content = self.files.get(self.path)
        if content is None:
            self.send_error(404)
        return content

    def do_HEAD(self) -> None:
        content = self._body()
        if content is not None:
            self.send_response(200)
            if self.ranges:
                self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()

    def do_GET(self) -> None:
        content = self._body()
        if content is None:
            return
        wanted = self.headers.get("Range")
        type(self).seen.append((self.path, wanted))
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", wanted or "")
        if self.ranges and match:
            start, stop = int(match.group(1)), min(int(match.group(2)) + 1, len(content))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(content)}")
            body = content[start:stop]
        else:
            self.send_response(200)
            body = content
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def http_files():
    servers = []

    def serve(files: dict, ranges: bool):
        handler = type("Handler", (_Files,), {"files": files, "ranges": ranges, "seen": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", handler

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("ranges", [True, False])
@pytest.mark.slow
def test_http_whole_objects_in_parts_where_the_server_answers_ranges(small_parts, http_files, ranges):
    data = payload()
    base, handler = http_files({"/blob.tar": data}, ranges)
    assert locate(f"{base}/blob.tar").fetch_checked(SIZE, None) == data
    if ranges:  # the first 700 bytes, then parts of 1000
        assert len(handler.seen) == 1 + -(-(SIZE - 700) // 1000) and handler.seen[0] == ("/blob.tar", "bytes=0-699")
    else:  # asked for a range, answered with the whole body: that one stream
        assert handler.seen == [("/blob.tar", "bytes=0-699")]


@pytest.mark.parametrize("ranges", [True, False])
@pytest.mark.slow
def test_http_tar_slices_by_index_where_the_server_answers_ranges(tmp_path, http_files, ranges):
    local = packed(tmp_path / "data")
    files = {f"/data/{p.relative_to(local).as_posix()}": p.read_bytes() for p in local.rglob("*") if p.is_file()}
    base, handler = http_files(files, ranges)

    def epoch(path):
        dataset = shards.open_dataset(path, "train", seed=5, return_keys=True,
                                      decode=shards.Decode(decoder=lambda sample, seed: sample.data),
                                      distributed=shards.Distributed(rank=0, world_size=1))
        return [(key, data) for data, _, key in dataset]

    assert epoch(f"{base}/data") == epoch(local)
    shard_gets = [wanted for path, wanted in handler.seen if path.endswith(".tar")]
    if ranges:  # each slice exactly its bytes, by range
        assert shard_gets and all(wanted is not None for wanted in shard_gets)
    else:  # each shard as one stream from its first byte, no index fetched
        assert shard_gets and all(wanted is None for wanted in shard_gets)
        assert not any(path.endswith(".idx") for path, _ in handler.seen)


@pytest.mark.slow
def test_hdf5_fills_its_block_cache_in_parts(bucket, tmp_path, monkeypatch):
    from tests.s3.test_read import samples

    local = packed(tmp_path / "data", "hdf5")
    url = bucket.upload(local, "data")
    expected = samples(local)
    monkeypatch.setattr(parallel_parts, "PART", 4096)  # every block cache fill is longer than one part
    s3.FETCH_STATS.reset()
    assert samples(url) == expected
    shard_bytes = sum(p.stat().st_size for p in local.glob("train-*.h5"))
    assert s3.FETCH_STATS.requests > shard_bytes // (1 << 20) + 3  # parts, not one GET per fill


def test_feature_shards_are_fetched_ahead_each_once(bucket, tmp_path, s3_env):
    """The in-process feature loader starts the next remote feature shards while it loads one: whole objects
    overlap (two in flight at once, each shard a single part here), and every byte is fetched once."""
    from tests.train.conftest import write_feature_folder

    folder = write_feature_folder(tmp_path / "f", shard_sizes={"train": [7, 5, 6, 4, 8]}, classes=["a", "b", "c"])
    url = bucket.upload(folder, "features")

    def batches(path, **remote):
        dataset = shards.open_dataset(path, "train", seed=3, cache="none", remote=shards.Remote(**remote),
                                      distributed=shards.Distributed(rank=0, world_size=1))
        loader = shards.make_loader(dataset, batch_size=4)
        return dataset, [(features.tolist(), labels.tolist()) for features, labels in loader]

    dataset, expected = batches(folder)
    drop_read_ahead()
    with LinkProxy(s3_env.endpoint_url, latency_s=0.05) as link:
        s3.FETCH_STATS.reset()
        _, got = batches(url, storage_options={"endpoint_url": link.endpoint_url, "max_concurrency": 4})
        assert got == expected
        assert link.max_in_flight >= 2
    shard_bytes = sum(info.bytes for info in dataset.split_info.shards)
    manifest_bytes = (folder / "features.json").stat().st_size
    assert s3.FETCH_STATS.bytes == shard_bytes + manifest_bytes
    assert READ_AHEAD.held_bytes() == 0
