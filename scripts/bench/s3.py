"""Benchmark: the same tar dataset read from local disk and from a local S3 server (SeaweedFS ``weed mini``), the
server reached through a network link model (``tests.s3.link.LinkProcess``: a proxy in a process of its own) with
the model off and on.

Passes, 2 workers by default, interleaved rounds, best of ``--repeat`` (``scripts/bench/loader.py``'s corpus,
packing and timing, imported): I/O-only (samples counted, not decoded) and the fast pipeline, each from the local
folder and from ``s3://`` through the proxy: the link model off (``nolink``), on with one request in flight per
worker (``link_seq``: ``max_concurrency=1, read_ahead_bytes=0``, the reader before parallel parts) and on with the
defaults (``link``: parallel parts and read-ahead along the plan). The link model: ``--latency-ms`` (default 20)
added to every request, each connection capped at ``--rate-mb`` MB/s (default 60). Page caches of the local shards
and of the server's volume files are dropped before every pass. Also: whole-object fetches (``fetch_checked`` of
every shard object, what feature shards and the node cache do) over the link vs without, sequential vs parallel,
and the same for ``--large-objects`` objects of ``--large-mb`` MiB (a feature shard's size; over the link also
for ``max_concurrency`` 1 to 16: how the default was chosen); one epoch of the in-process feature loader over
``--feature-shards`` feature shards of 4 MiB (whole objects, the next ones read ahead) with each link setting;
the bytes fetched per sample read (counted by ``shards.transport.s3`` across the workers) against the bytes those
samples occupy in their shards; without ``--quick``, the S3 server's CPU share and the raw GET throughput of the
two S3 clients tried (boto3/botocore and obstore, when installed).

    python scripts/bench/s3.py --quick           # 600 images, 1 round, ~2 minutes on 2 cores
    python scripts/bench/s3.py --repeat 3        # 3000 images (~300 MB)

The server and the proxy are started on free loopback ports and stopped at the end. stdout: one JSON line; the
table: stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import logging
import os
import random
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
from shards.transport import s3  # noqa: E402
from shards.transport import s3_ranges  # noqa: E402
from shards.jobs.progress import setup_logging  # noqa: E402
from shards.loader.loader import workers_mode  # noqa: E402
from tests.s3.link import LinkProcess  # noqa: E402
from tests.s3.server import ACCESS_KEY, SECRET_KEY, start_server  # noqa: E402

log = logging.getLogger("bench.s3")
CONCURRENCY_SWEEP = (1, 2, 4, 8, 16)  # max_concurrency values whose whole-object rate over the link is measured


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


def io_only(location, args, storage_options=None):
    dataset = shards.open_dataset(location, decode=shards.Decode(decoder=bench.ByteCount()), seed=0,
                                  remote=shards.Remote(storage_options=storage_options))
    dataset.verify_sha256 = False
    return shards.make_loader(dataset, batch_size=args.batch_size, mode=workers_mode(args.workers, persistent=False),
                              drop_last=False)


def fast_uint8(location, args, storage_options=None):
    """The fast pipeline's uint8 batches (``loader.fast_batches(consumer="uint8")``) with the storage options."""
    dataset = shards.open_dataset(location, transform=bench.SPEC, decode=shards.Decode("fast"), seed=0,
                                  remote=shards.Remote(storage_options=storage_options))
    dataset.verify_sha256 = False
    return shards.make_loader(dataset, batch_size=args.batch_size, mode=workers_mode(args.workers, persistent=False),
                              drop_last=False)


def fetched_per_sample(url: str, folder: Path, args, count: int, storage_options=None) -> dict[str, float]:
    """One I/O-only epoch from S3 with the byte counter shared by the workers."""
    s3.share_stats()
    s3.FETCH_STATS.reset()
    seen = sum(len(labels) for _, labels in io_only(url, args, storage_options))
    fetched, requests = s3.FETCH_STATS.bytes, s3.FETCH_STATS.requests
    manifest = json.loads((folder / "dataset.json").read_text())
    shard_bytes = sum(s["bytes"] - 1024 for s in manifest["splits"]["train"]["shards"])  # less end-of-archive
    image_bytes = sum(p.stat().st_size for p in (folder.parent / "images").rglob("*.jpg"))
    return {"samples": seen, "bytes_fetched": fetched, "requests": requests,
            "bytes_per_sample": fetched / seen, "vs_sample_bytes_in_shards": fetched / shard_bytes,
            "vs_image_bytes": fetched / image_bytes}


def raw_gets(bucket: str, keys: list[str], endpoint: str, repeat: int, drop) -> dict[str, float]:
    """MB/s of whole-object GETs, 2 in flight, boto3 (through shards.transport.s3) and, when it is installed,
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
    parser.add_argument("--repeat", type=int, default=None, help="rounds (default 3; 1 with --quick)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the corpus here between runs")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="the link model: added to every request")
    parser.add_argument("--rate-mb", type=float, default=60.0, help="the link model: MB/s per connection")
    parser.add_argument("--large-objects", type=int, default=4, help="whole-object fetches of this many objects...")
    parser.add_argument("--large-mb", type=int, default=32, help="...of this many MiB (a feature shard's size)")
    parser.add_argument("--feature-shards", type=int, default=16, help="feature shards of 4 MiB each (the "
                        "feature loader's epoch over the link)")
    parser.add_argument("--quick", action="store_true", help="600 images, 1 round unless --repeat, no CPU shares "
                        "or raw GETs")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.images, args.per_shard = min(args.images, 600), min(args.per_shard, 60)
    args.repeat = args.repeat or (1 if args.quick else 3)
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


def large_objects(bucket: str, count: int, megabytes: int) -> dict[str, int]:
    """``count`` objects of ``megabytes`` seeded random bytes (the size of a feature shard), uploaded once."""
    import boto3

    client, objects = boto3.client("s3"), {}
    for i in range(count):
        data = random.Random(i).randbytes(megabytes << 20)
        client.put_object(Bucket=bucket, Key=f"bench/large/{i}.bin", Body=data)
        objects[f"s3://{bucket}/bench/large/{i}.bin"] = len(data)
    return objects


def whole_objects(urls: list[str], link: LinkProcess, settings: dict, sizes: dict[str, int], drop) -> float:
    """MB/s of ``fetch_checked`` of every object in turn (a feature shard, the node cache's fetch)."""
    from shards.transport.location import locate

    link.set_link(*settings["link"])
    drop()
    began = time.perf_counter()
    for url in urls:
        locate(url, storage_options=settings["options"]).fetch_checked(sizes[url], None)
    return sum(sizes.values()) / (time.perf_counter() - began) / 1e6


def whole_object_rates(server, shard_sizes: dict[str, int], link: LinkProcess, settings: dict, args):
    """MB/s of whole-object fetches per link setting: the tar shards, and ``--large-objects`` of ``--large-mb``
    MiB (also over the link for each ``max_concurrency`` of ``CONCURRENCY_SWEEP``)."""
    def drop() -> None:  # the server's volume files as they are now (the large objects add some)
        bench.drop_cache([p for p in (server.log_path.parent / "data").rglob("*") if p.is_file()])

    large = large_objects(server.bucket, args.large_objects, args.large_mb)
    whole, whole_large = ({name: max(whole_objects(list(objects), link, settings[name], objects, drop)
                                     for _ in range(args.repeat)) for name in settings}
                          for objects in (shard_sizes, large))
    link_options = settings["link"]["options"]
    sweep = {n: whole_objects(list(large), link, {"link": settings["link"]["link"],
                                                  "options": {**link_options, "max_concurrency": n}}, large, drop)
             for n in CONCURRENCY_SWEEP}
    return whole, whole_large, sweep


def feature_rates(server, link: LinkProcess, settings: dict, args, workdir: Path) -> dict[str, float]:
    """MB/s of one epoch of the in-process feature loader (``cache="none"``) over ``--feature-shards`` feature
    shards of 1,000 rows of 2,048 float16 values (4 MiB: ImageNet-size resnet50 features) per link setting: what
    ``train-from-shards`` on cached features reads (whole objects, the next ones read ahead while one loads)."""
    from tests.train.conftest import write_feature_folder

    folder = write_feature_folder(workdir / "features", shard_sizes={"train": [1000] * args.feature_shards},
                                  classes=[f"c{i}" for i in range(10)], dim=2048)
    url = upload(folder, server.bucket, "bench/features")
    total = sum(p.stat().st_size for p in folder.glob("*.pt"))

    def epoch(name: str) -> float:
        link.set_link(*settings[name]["link"])
        bench.drop_cache([p for p in (server.log_path.parent / "data").rglob("*") if p.is_file()])
        began = time.perf_counter()
        dataset = shards.open_dataset(url, "train", seed=0, cache="none",
                                      remote=shards.Remote(storage_options=settings[name]["options"]),
                                      distributed=shards.Distributed(rank=0, world_size=1))
        rows = sum(len(labels) for _, labels in shards.make_loader(dataset, batch_size=4096, drop_last=False))
        assert rows == 1000 * args.feature_shards
        return total / (time.perf_counter() - began) / 1e6

    return {name: max(epoch(name) for _ in range(args.repeat)) for name in settings}


def run(args, workdir: Path, server) -> None:
    files = bench.build_corpus(workdir / "images", args.images)
    folder = workdir / "tar"
    bench.pack(files, folder, "tar", args.per_shard)
    add_index(folder)
    url = upload(folder, server.bucket, "bench/tar")
    os.sync()
    tars = sorted(folder.glob("*.tar"))
    weed_files = [p for p in (server.log_path.parent / "data").rglob("*") if p.is_file()]
    model = (args.latency_ms / 1000, args.rate_mb * 1e6)
    with LinkProcess(server.endpoint_url) as link:
        endpoint = {"endpoint_url": link.endpoint_url}
        settings = {"nolink": {"link": (0.0, 0.0), "options": endpoint},
                    "link_seq": {"link": model, "options": {**endpoint, "max_concurrency": 1, "read_ahead_bytes": 0}},
                    "link": {"link": model, "options": endpoint}}

        def through(name: str, make):
            def start():
                link.set_link(*settings[name]["link"])
                return make(url, args, settings[name]["options"])
            return start

        passes = {"io_local": (lambda: io_only(folder, args), tars),
                  "fast_local": (lambda: fast_uint8(folder, args), tars)}
        for name in settings:
            passes[f"io_{name}"] = (through(name, io_only), weed_files)
            passes[f"fast_{name}"] = (through(name, fast_uint8), weed_files)
        bench.NOT_FLOAT = (*bench.NOT_FLOAT, *passes)
        rates = bench.best_of_rounds(passes, len(files), args.repeat)
        sizes = {f"{url}/{p.name}": p.stat().st_size for p in tars}
        whole, whole_large, sweep = whole_object_rates(server, sizes, link, settings, args)
        features = feature_rates(server, link, settings, args, workdir)
        link.set_link(*model)
        fetched = fetched_per_sample(url, folder, args, len(files), settings["link"]["options"])
        link.set_link(0.0, 0.0)
        server_cpu, client_ms = ({}, {}) if args.quick else cpu_shares(server, passes, len(files))
    raw = {} if args.quick else raw_gets(server.bucket, [f"bench/tar/{p.name}" for p in tars], server.endpoint_url,
                                         args.repeat, lambda: bench.drop_cache(weed_files))
    ratios = {"io_link_vs_nolink": rates["io_link"] / rates["io_nolink"],
              "fast_link_vs_nolink": rates["fast_link"] / rates["fast_nolink"],
              "io_link_seq_vs_nolink": rates["io_link_seq"] / rates["io_nolink"],
              "fast_link_seq_vs_nolink": rates["fast_link_seq"] / rates["fast_nolink"],
              "whole_objects_link_vs_nolink": whole["link"] / whole["nolink"],
              "whole_objects_link_seq_vs_nolink": whole["link_seq"] / whole["nolink"],
              "large_objects_link_vs_nolink": whole_large["link"] / whole_large["nolink"],
              "large_objects_link_seq_vs_nolink": whole_large["link_seq"] / whole_large["nolink"],
              "features_link_vs_nolink": features["link"] / features["nolink"],
              "features_link_seq_vs_nolink": features["link_seq"] / features["nolink"],
              "io_link_vs_local": rates["io_link"] / rates["io_local"],
              "fast_link_vs_local": rates["fast_link"] / rates["fast_local"]}
    skipped = []
    if client_ms:
        # the client's CPU per image, S3 over local: with the store on another machine and the reader CPU-bound,
        # the throughput ratio to expect is about the inverse of this
        ratios["io_client_cpu_s3_vs_local"] = client_ms["io_nolink"] / client_ms["io_local"]
        ratios["fast_client_cpu_s3_vs_local"] = client_ms["fast_nolink"] / client_ms["fast_local"]
        log.info("the S3 server itself used %.2f cores during the I/O-only pass and %.2f during the fast pass "
                 "(of 2)", server_cpu["io_nolink"], server_cpu["fast_nolink"])
    if "obstore" in raw:
        ratios["obstore_vs_boto3_raw_get"] = raw["obstore"] / raw["boto3"]
    elif not args.quick:
        skipped.append("obstore raw GET comparison (obstore not installed)")
    for name, rate in rates.items():
        log.info("%-16s %8.1f img/s", name, rate)
    for name, rate in whole.items():
        log.info("whole shard objects %-9s %8.1f MB/s", name, rate)
    for name, rate in whole_large.items():
        log.info("whole %d MiB objects %-9s %8.1f MB/s", args.large_mb, name, rate)
    for name, rate in features.items():
        log.info("feature loader epoch %-9s %8.1f MB/s", name, rate)
    log.info("feature shards over the link: %.2fx of no link (goal >= 0.8; one request in flight: %.2fx)",
             ratios["features_link_vs_nolink"], ratios["features_link_seq_vs_nolink"])
    log.info("whole %d MiB objects over the link by max_concurrency: %s", args.large_mb,
             ", ".join(f"{n}: {rate:.1f} MB/s" for n, rate in sweep.items()))
    log.info("link model %.0f ms/request, %.0f MB/s per connection: link/no link I/O-only %.2fx (goal >= 0.8; "
             "one request in flight: %.2fx), fast %.2fx (goal >= 0.95; %.2fx), whole objects %.2fx (goal >= 0.8; "
             "%.2fx), %d MiB ones %.2fx (%.2fx); fetched %.3fx the samples' shard bytes (goal <= 1.02), %d requests",
             args.latency_ms, args.rate_mb, ratios["io_link_vs_nolink"], ratios["io_link_seq_vs_nolink"],
             ratios["fast_link_vs_nolink"], ratios["fast_link_seq_vs_nolink"], ratios["whole_objects_link_vs_nolink"],
             ratios["whole_objects_link_seq_vs_nolink"], args.large_mb, ratios["large_objects_link_vs_nolink"],
             ratios["large_objects_link_seq_vs_nolink"], fetched["vs_sample_bytes_in_shards"], fetched["requests"])
    print(json.dumps({"images": len(files), "shards": len(tars), "workers": args.workers, "repeat": args.repeat,
                      "link_model": {"latency_ms": args.latency_ms, "rate_mb_per_connection": args.rate_mb},
                      "images_per_s": {k: round(v, 1) for k, v in rates.items()},
                      "whole_objects_mb_per_s": {k: round(v, 1) for k, v in whole.items()},
                      "large_objects_mb_per_s": {k: round(v, 1) for k, v in whole_large.items()},
                      "large_objects_mb": args.large_mb,
                      "feature_loader_mb_per_s": {k: round(v, 1) for k, v in features.items()},
                      "large_objects_link_mb_per_s_by_max_concurrency": {n: round(v, 1) for n, v in sweep.items()},
                      "ratios": {k: round(v, 3) for k, v in ratios.items()},
                      "fetched": {k: round(v, 4) if isinstance(v, float) else v for k, v in fetched.items()},
                      "raw_get_mb_per_s": {k: round(v, 1) for k, v in raw.items()},
                      "server_cores_used": {k: round(v, 2) for k, v in server_cpu.items()},
                      "client_cpu_ms_per_image": {k: round(v, 3) for k, v in client_ms.items()},
                      "skipped": skipped}))


if __name__ == "__main__":
    main()
