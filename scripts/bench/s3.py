"""Benchmark: the same tar dataset read from local disk and from a local S3 server (SeaweedFS ``weed mini``).

Passes, 2 workers by default, interleaved rounds, best of ``--repeat`` (``scripts/bench/loader.py``'s corpus,
packing, loaders and timing, imported): I/O-only (samples counted, not decoded) and the fast pipeline, each from the
local folder and from ``s3://``. Page caches of the local shards and of the server's volume files are dropped
before every pass. Also: the bytes fetched from S3 per sample read (counted by ``shards.formats.s3`` across the
workers) against the bytes those samples occupy in their shards, and the raw GET throughput of the two S3 clients
tried (boto3/botocore and obstore), whole shard objects, 2 at a time. obstore is not a dependency of shardcache: its
comparison runs only when it is installed (``pip install obstore``); otherwise the run says it was skipped.

    python scripts/bench/s3.py --repeat 3        # 3000 images (~300 MB), ~2 minutes on 2 cores

The server is started on free loopback ports and stopped at the end. stdout: one JSON line; the table: stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import loader as bench  # noqa: E402  (scripts/bench/loader.py: corpus, packing, loaders, timing)
import shards  # noqa: E402
from shards.formats import s3, s3_ranges  # noqa: E402
from shards.progress import setup_logging  # noqa: E402
from tests.s3.server import ACCESS_KEY, SECRET_KEY, start_server  # noqa: E402

log = logging.getLogger("bench.s3")


def add_index(folder: Path) -> None:
    """Record the tar writer's ``.idx`` sidecars in dataset.json, as pack-shards does."""
    path = folder / "dataset.json"
    manifest = json.loads(path.read_text())
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            index = folder / (shard["path"] + ".idx")
            shard["index"] = index.name
            shard["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    path.write_text(json.dumps(manifest))


def upload(folder: Path, bucket: str, prefix: str) -> str:
    import boto3

    client = boto3.client("s3")
    for path in sorted(folder.iterdir()):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
    return f"s3://{bucket}/{prefix}"


def io_only(location, args):
    dataset = shards.open_dataset(location, decode=shards.Decode(decoder=bench.ByteCount()), seed=0)
    dataset.verify_sha256 = False
    return shards.make_loader(dataset, batch_size=args.batch_size, num_workers=args.workers, drop_last=False,
                              persistent_workers=False)


def fetched_per_sample(url: str, folder: Path, args, count: int) -> dict[str, float]:
    """One I/O-only epoch from S3 with the byte counter shared by the workers."""
    s3.share_stats()
    s3.FETCH_STATS.reset()
    seen = sum(len(labels) for _, labels in io_only(url, args))
    fetched, requests = s3.FETCH_STATS.bytes, s3.FETCH_STATS.requests
    manifest = json.loads((folder / "dataset.json").read_text())
    shard_bytes = sum(s["bytes"] - 1024 for s in manifest["splits"]["train"]["shards"])  # less end-of-archive
    image_bytes = sum(p.stat().st_size for p in (folder.parent / "images").rglob("*.jpg"))
    return {"samples": seen, "bytes_fetched": fetched, "requests": requests,
            "bytes_per_sample": fetched / seen, "vs_sample_bytes_in_shards": fetched / shard_bytes,
            "vs_image_bytes": fetched / image_bytes}


def raw_gets(bucket: str, keys: list[str], endpoint: str, repeat: int, drop) -> dict[str, float]:
    """MB/s of whole-object GETs, 2 in flight, boto3 (through shards.formats.s3) and, when it is installed,
    obstore (only the clients measured are in the result)."""
    clients = {"boto3": lambda key: len(s3_ranges.read_object(f"s3://{bucket}/{key}"))}
    try:
        from obstore import get as obstore_get
        from obstore.store import S3Store
    except ImportError:
        log.warning("obstore is not installed: its raw GET comparison was skipped (pip install obstore)")
    else:
        store = S3Store(bucket, endpoint=endpoint, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                        region="us-east-1", client_options={"allow_http": True})
        clients["obstore"] = lambda key: len(obstore_get(store, key).bytes())
    rates: dict[str, float] = {}
    for _ in range(repeat):
        for name, get in clients.items():
            drop()
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                total = sum(pool.map(get, keys))
            rate = total / (time.perf_counter() - start) / 1e6
            log.info("raw GET %-8s %8.1f MB/s", name, rate)
            rates[name] = max(rates.get(name, 0.0), rate)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--per-shard", type=int, default=150)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the corpus here between runs")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    setup_logging(quiet=args.quiet)
    with_server(run, args, "s3", keep=args.workdir)


def with_server(run, args, name: str, keep: Path | None = None) -> None:
    """``run(args, workdir, server)`` with a local S3 server on free ports and the AWS variables pointing at it;
    the server and the work folder (unless ``keep`` names it) are removed afterwards, also on failure."""
    workdir = keep or Path(tempfile.mkdtemp(prefix=f"shardcache-bench-{name}-"))
    server = start_server(Path(tempfile.mkdtemp(prefix="shardcache-bench-weed-")))
    os.environ.update(server.client_env())
    try:
        run(args, workdir, server)
    finally:
        server.stop()
        shutil.rmtree(server.log_path.parent, ignore_errors=True)
        if keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (the S3 server) so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_cpu_s() -> float:
    """User + system CPU seconds of this process and its finished children (the DataLoader workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def cpu_shares(server, passes: dict, expected: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per pass: how much of the 2 cores the S3 server itself burns (the CPU a real remote store would not take
    from the workers, and the reason the S3/local ratios here understate what a node with a remote store sees),
    and the client's CPU milliseconds per image (reader process and workers, server excluded)."""
    server_cores, client_ms = {}, {}
    for name, (make, paths) in passes.items():
        server_before, client_before = process_cpu_s(server.process.pid), client_cpu_s()
        started = time.perf_counter()
        bench.timed_pass(name, make, paths, expected)
        server_cores[name] = (process_cpu_s(server.process.pid) - server_before) / (time.perf_counter() - started)
        client_ms[name] = (client_cpu_s() - client_before) * 1000 / expected
    return server_cores, client_ms


def run(args, workdir: Path, server) -> None:
    files = bench.build_corpus(workdir / "images", args.images)
    folder = workdir / "tar"
    bench.pack(files, folder, "tar", args.per_shard)
    add_index(folder)
    url = upload(folder, server.bucket, "bench/tar")
    os.sync()
    tars = sorted(folder.glob("*.tar"))
    weed_files = [p for p in (server.log_path.parent / "data").rglob("*") if p.is_file()]
    passes = {
        "io_local": (lambda: io_only(folder, args), tars),
        "io_s3": (lambda: io_only(url, args), weed_files),
        "fast_local": (lambda: bench.fast_batches(folder, args, consumer="uint8", verify_sha256=False), tars),
        "fast_s3": (lambda: bench.fast_batches(url, args, consumer="uint8", verify_sha256=False), weed_files),
    }
    bench.NOT_FLOAT = (*bench.NOT_FLOAT, *passes)
    rates = bench.best_of_rounds(passes, len(files), args.repeat)
    server_cpu, client_ms = cpu_shares(server, passes, len(files))
    fetched = fetched_per_sample(url, folder, args, len(files))
    keys = [f"bench/tar/{p.name}" for p in tars]
    raw = raw_gets(server.bucket, keys, server.endpoint_url, args.repeat, lambda: bench.drop_cache(weed_files))
    ratios = {"io_s3_vs_local": rates["io_s3"] / rates["io_local"],
              "fast_s3_vs_local": rates["fast_s3"] / rates["fast_local"],
              # the client's CPU per image, S3 over local: with the store on another machine and the reader
              # CPU-bound, the throughput ratio to expect is about the inverse of this
              "io_client_cpu_s3_vs_local": client_ms["io_s3"] / client_ms["io_local"],
              "fast_client_cpu_s3_vs_local": client_ms["fast_s3"] / client_ms["fast_local"]}
    skipped = []
    if "obstore" in raw:
        ratios["obstore_vs_boto3_raw_get"] = raw["obstore"] / raw["boto3"]
    else:
        skipped.append("obstore raw GET comparison (obstore not installed)")
    for name, rate in rates.items():
        log.info("%-12s %8.1f img/s", name, rate)
    log.info("the S3 server itself used %.2f cores during the I/O-only pass and %.2f during the fast pass (of 2)",
             server_cpu["io_s3"], server_cpu["fast_s3"])
    log.info("client CPU per image, S3/local (server excluded): I/O-only %.2fx, fast %.2fx",
             ratios["io_client_cpu_s3_vs_local"], ratios["fast_client_cpu_s3_vs_local"])
    log.info("S3/local: I/O-only %.2fx (goal >= 0.7), fast %.2fx (goal >= 0.95); fetched %.3fx the samples' "
             "shard bytes (goal <= 1.05), %d requests", ratios["io_s3_vs_local"], ratios["fast_s3_vs_local"],
             fetched["vs_sample_bytes_in_shards"], fetched["requests"])
    print(json.dumps({"images": len(files), "shards": len(tars), "workers": args.workers, "repeat": args.repeat,
                      "images_per_s": {k: round(v, 1) for k, v in rates.items()},
                      "ratios": {k: round(v, 3) for k, v in ratios.items()},
                      "fetched": {k: round(v, 4) if isinstance(v, float) else v for k, v in fetched.items()},
                      "raw_get_mb_per_s": {k: round(v, 1) for k, v in raw.items()},
                      "server_cores_used": {k: round(v, 2) for k, v in server_cpu.items()},
                      "client_cpu_ms_per_image": {k: round(v, 3) for k, v in client_ms.items()},
                      "skipped": skipped}))


if __name__ == "__main__":
    main()
