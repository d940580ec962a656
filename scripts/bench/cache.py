"""Benchmark: two epochs of the fast pipeline, 2 ranks x 2 workers, with and without the node-local shard cache.

Sources, side by side in one run: the tar dataset on local disk (the reference), the same dataset on a local S3
server (SeaweedFS ``weed mini``) read directly, and from S3 through a fresh node cache (both ranks share it, as two
ranks of one node do); then the same two ways from a throttled HTTP server (``--slow-mb-s``, all readers together:
a busy shared file system). Each configuration runs its two ranks as two processes with ``rank``/``world_size`` given,
so no process group is needed; an epoch's rate is all samples over the slower rank's time. Page caches of the local
shards, the server's volume files and the cache folder are dropped before each configuration.

Prints per configuration: epoch-1 and epoch-2 img/s, bytes fetched from S3 over both epochs against the dataset's
bytes, and the cache's counters; then the ratios the goals name (bytes fetched with the cache over 2 epochs at most
1.05x the dataset; epoch 2 with the cache at least 0.95x local disk).

    python scripts/bench/cache.py            # 3000 images (~300 MB), 2 rounds, ~3 minutes on 2 cores

``--over-limit`` gives the node cache half the split's bytes (the data bigger than the disk): 4 epochs each with no
cache, eviction by next use, LRU, and a limit that holds the split; bytes fetched per epoch against the split (goal
after the first: <= 0.55x by next use; 1.000x over all epochs when the split fits) and the rate of epochs 2-4
against no cache (goal >= 1).

    python scripts/bench/cache.py --over-limit     # 2000 images in 80 shards, ~4 minutes on 2 busy cores

``--verify-cost`` measures instead (no S3 server) what the cache's first-use rehash of a copy costs: sha256 MB/s
of the cached copies, and one process's epoch from a warm cache that rehashes every copy (its first) against the
next (copies already checked), for raw reading and for the fast pipeline.

    python scripts/bench/cache.py --verify-cost --images 1000

stdout: one JSON line; the table: stderr.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import loader as bench  # noqa: E402  (scripts/bench/loader.py: corpus, packing, page-cache dropping)
import s3 as s3bench  # noqa: E402  (scripts/bench/s3.py: index recording and upload)
import shards  # noqa: E402
from shards.atomic import sha256_file  # noqa: E402
from shards.transport import s3  # noqa: E402
from shards.jobs.progress import setup_logging  # noqa: E402
from shards.loader.loader import workers_mode  # noqa: E402

log = logging.getLogger("bench.cache")
EPOCHS = 2
OVER_LIMIT_EPOCHS = 4
CHUNK = 256 << 10


class ThrottledHandler(http.server.SimpleHTTPRequestHandler):
    """A slow shared file system stand-in: every connection together gets at most ``rate`` bytes/s (a token bucket
    shared by the server's threads), and the bytes sent are counted."""

    rate = 100e6
    sent = 0
    _lock = threading.Lock()
    _next_free = 0.0

    def log_message(self, *args) -> None:
        pass

    def copyfile(self, source, outputfile) -> None:
        while chunk := source.read(CHUNK):
            with ThrottledHandler._lock:
                now = time.perf_counter()
                start = max(now, ThrottledHandler._next_free)
                ThrottledHandler._next_free = start + len(chunk) / self.rate
                ThrottledHandler.sent += len(chunk)
            time.sleep(max(0.0, start - now))
            try:
                outputfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):  # a reader that needed only the first samples
                return


def throttled_server(folder: Path, rate: float) -> tuple[http.server.ThreadingHTTPServer, str]:
    ThrottledHandler.rate = rate
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                             functools.partial(ThrottledHandler, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def rank_main(rank: int, location: str, cache: shards.ShardCache | None, epochs: int, args, start, results) -> None:
    """One rank: ``epochs`` epochs of uint8 batches (the GPU consumer's view), timed per epoch after a shared start;
    the bytes its workers fetched from S3 in each epoch."""
    s3.share_stats()  # this rank's workers add their GETs to its counters
    dataset = shards.open_dataset(location, transform=bench.SPEC, decode=shards.Decode("fast"), seed=0,
                                  distributed=shards.Distributed(rank=rank, world_size=2),
                                  remote=shards.Remote(shard_cache=cache or shards.ShardCache()))
    loader = shards.make_loader(dataset, batch_size=args.batch_size, mode=workers_mode(args.workers), drop_last=False)
    seconds, fetched, seen = [], [], 0
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        start.wait()  # the ranks begin each epoch together, as a DDP job's steps keep them
        began, fetched_before = time.perf_counter(), s3.FETCH_STATS.bytes
        for _, labels in loader:
            seen += len(labels)
        seconds.append(time.perf_counter() - began)
        fetched.append(s3.FETCH_STATS.bytes - fetched_before)
    counts = dataset.shard_cache.summary() if dataset.shard_cache is not None else None
    results.put({"rank": rank, "seconds": seconds, "samples": seen, "fetched": fetched, "cache": counts})


def run_config(name: str, location: str, cache: shards.ShardCache | None, args, drop: list[Path],
               epochs: int = EPOCHS) -> dict:
    bench.drop_cache(drop)
    sent_before = ThrottledHandler.sent
    context = multiprocessing.get_context("fork")
    start, results = context.Barrier(2), context.Queue()
    ranks = [context.Process(target=rank_main, args=(r, location, cache, epochs, args, start, results))
             for r in (0, 1)]
    for process in ranks:
        process.start()
    rows = [results.get(timeout=1800) for _ in ranks]
    for process in ranks:
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"{name}: rank process exited with {process.exitcode}")
    samples = sum(r["samples"] for r in rows)
    rates = [samples / epochs / max(r["seconds"][e] for r in rows) for e in range(epochs)]
    caches = [r["cache"] for r in rows if r["cache"]]
    counts = {k: sum(c[k] for c in caches) for k in caches[0] if k != "hit_rate"} if caches else None
    per_epoch = [sum(r["fetched"][e] for r in rows) for e in range(epochs)]
    fetched = sum(per_epoch) + ThrottledHandler.sent - sent_before
    out = {"epoch_img_per_s": [round(r, 1) for r in rates], "fetched_bytes": fetched,
           "fetched_per_epoch": per_epoch, "samples": samples, "cache": counts}
    log.info("%-10s %s img/s per epoch, fetched %.1f MB%s", name, " / ".join(f"{r:.1f}" for r in rates),
             out["fetched_bytes"] / 1e6, f", cache {counts}" if counts else "")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=None, help="default 3000; 2000 with --over-limit")
    parser.add_argument("--per-shard", type=int, default=None, help="default 150; 25 with --over-limit")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the best epoch rates are kept")
    parser.add_argument("--slow-mb-s", type=float, default=100.0,
                        help="bandwidth of the throttled HTTP source (a busy shared file system), all readers together")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--verify-cost", action="store_true",
                        help="measure only the first-use sha256 check of cached copies (no S3 server)")
    parser.add_argument("--over-limit", action="store_true",
                        help="a cache limit of half the split: eviction by next use against LRU and no cache, "
                             f"{OVER_LIMIT_EPOCHS} epochs")
    args = parser.parse_args()
    # Over the limit, the cache must hold many shards beside the ones its 4 readers are reading and fetching next
    # (8 here), as a real node's does (docs/caching.md, "Measured"): 80 shards, the cache holds 40.
    args.images = args.images or (2000 if args.over_limit else 3000)
    args.per_shard = args.per_shard or (25 if args.over_limit else 150)
    setup_logging(quiet=args.quiet)
    if args.verify_cost:
        verify_cost(args)
        return
    s3bench.with_server(over_limit if args.over_limit else run, args, "cache")


def _epoch_seconds(dataset) -> float:
    began = time.perf_counter()
    for _ in dataset:
        pass
    return time.perf_counter() - began


def verify_cost(args) -> None:
    """The node cache rehashes a copy the first time a process uses it (``shards.cache.node``). Measured in
    one process with the page cache warm (the cost is then all sha256 CPU): the hash rate alone, and per pipeline
    the median over ``--repeat`` fresh datasets of the first epoch (every copy rehashed) against the second."""
    workdir = Path(tempfile.mkdtemp(prefix="shardcache-bench-verify-"))
    try:
        files = bench.build_corpus(workdir / "images", args.images)
        folder = workdir / "tar"
        bench.pack(files, folder, "tar", args.per_shard)
        node_cache = shards.ShardCache(workdir / "node-cache", local=True)
        options = dict(seed=0, remote=shards.Remote(shard_cache=node_cache))
        pipelines = {"io_only": dict(decode=shards.Decode(decoder=bench.ByteCount())),
                     "fast": dict(transform=bench.SPEC, decode=shards.Decode("fast"))}
        _epoch_seconds(shards.open_dataset(folder, **pipelines["io_only"], **options))  # fills the cache
        copies = sorted((workdir / "node-cache").glob("v1/??/*.tar"))
        dataset_bytes = sum(p.stat().st_size for p in copies)
        hash_s = min(_timed_hash(copies) for _ in range(3))
        results: dict[str, dict] = {}
        for name, pipeline in pipelines.items():
            firsts, seconds = [], []
            for _ in range(args.repeat):
                dataset = shards.open_dataset(folder, **pipeline, **options)  # a new job: no copy checked yet
                firsts.append(_epoch_seconds(dataset))
                seconds.append(_epoch_seconds(dataset))
            first, second = sorted(firsts)[len(firsts) // 2], sorted(seconds)[len(seconds) // 2]
            results[name] = {"first_epoch_s": round(first, 3), "next_epoch_s": round(second, 3),
                             "measured_overhead": round(first / second - 1, 3),
                             "hash_share_of_epoch": round(hash_s / second, 3)}
            log.info("%-8s first epoch (rehashes every copy) %.2f s, next %.2f s: %+.1f%%; hashing alone is %.1f%% "
                     "of an epoch", name, first, second, 100 * (first / second - 1), 100 * hash_s / second)
        rate = dataset_bytes / hash_s / 1e6
        log.info("sha256 of %d cached copies (%.0f MB): %.2f s, %.0f MB/s on one core", len(copies),
                 dataset_bytes / 1e6, hash_s, rate)
        print(json.dumps({"images": len(files), "shards": len(copies), "dataset_bytes": dataset_bytes,
                          "repeat": args.repeat, "sha256_mb_s": round(rate, 1), "hash_s": round(hash_s, 3),
                          "results": results}))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _timed_hash(paths: list[Path]) -> float:
    began = time.perf_counter()
    for path in paths:
        sha256_file(path)
    return time.perf_counter() - began


def packed_on_s3(args, workdir: Path, server) -> tuple[list[Path], Path, str, list[Path], list[Path]]:
    """The corpus packed into indexed tar shards and uploaded: (images, local folder, its s3:// URL, the local
    shards, the server's volume files whose page cache a pass drops)."""
    files = bench.build_corpus(workdir / "images", args.images)
    folder = workdir / "tar"
    bench.pack(files, folder, "tar", args.per_shard)
    s3bench.add_index(folder)
    url = s3bench.upload(folder, server.bucket, "bench/tar")
    os.sync()
    weed_files = [p for p in (server.log_path.parent / "data").rglob("*") if p.is_file()]
    return files, folder, url, sorted(folder.glob("*.tar")), weed_files


def run(args, workdir: Path, server) -> None:
    files, folder, url, tars, weed_files = packed_on_s3(args, workdir, server)
    dataset_bytes = sum(p.stat().st_size for p in tars)
    slow_server, slow_url = throttled_server(folder, args.slow_mb_s * 1e6)
    results: dict[str, dict] = {}
    for round_ in range(args.repeat):  # interleaved rounds; each configuration keeps its best epoch rates
        cache_dir = workdir / f"node-cache-{round_}"  # a cold cache every round
        for name, location, cache, drop in (
                ("local", str(folder), None, tars), ("s3", url, None, weed_files),
                ("s3_cache", url, shards.ShardCache(cache_dir / "s3"), weed_files), ("slow", slow_url, None, tars),
                ("slow_cache", slow_url, shards.ShardCache(cache_dir / "slow"), tars)):
            row = run_config(name, location, cache, args, drop)
            best = results.get(name)
            if best is not None:
                row["epoch_img_per_s"] = [max(a, b) for a, b in zip(row["epoch_img_per_s"], best["epoch_img_per_s"])]
            results[name] = row
        shutil.rmtree(cache_dir, ignore_errors=True)
    local, cached = results["local"]["epoch_img_per_s"], results["s3_cache"]["epoch_img_per_s"]
    ratios = {
        "cache_fetched_vs_dataset": results["s3_cache"]["fetched_bytes"] / dataset_bytes,
        "no_cache_fetched_vs_dataset": results["s3"]["fetched_bytes"] / dataset_bytes,
        "cache_epoch2_vs_local": cached[1] / local[1],
        "cache_epoch1_vs_s3_epoch1": cached[0] / results["s3"]["epoch_img_per_s"][0],
        "slow_cache_fetched_vs_dataset": results["slow_cache"]["fetched_bytes"] / dataset_bytes,
        "slow_cache_epoch2_vs_local": results["slow_cache"]["epoch_img_per_s"][1] / local[1],
        "slow_no_cache_epoch2_vs_local": results["slow"]["epoch_img_per_s"][1] / local[1],
    }
    slow_server.shutdown()
    log.info("with the cache, 2 epochs fetched %.3fx the dataset (goal <= 1.05; without: %.3fx); epoch 2 ran at "
             "%.2fx local disk (goal >= 0.95)", ratios["cache_fetched_vs_dataset"],
             ratios["no_cache_fetched_vs_dataset"], ratios["cache_epoch2_vs_local"])
    log.info("from a %.0f MB/s source: epoch 2 at %.2fx local disk with the cache, %.2fx without; fetched %.3fx the "
             "dataset over 2 epochs", args.slow_mb_s, ratios["slow_cache_epoch2_vs_local"],
             ratios["slow_no_cache_epoch2_vs_local"], ratios["slow_cache_fetched_vs_dataset"])
    print(json.dumps({"images": len(files), "shards": len(tars), "dataset_bytes": dataset_bytes, "ranks": 2,
                      "repeat": args.repeat,
                      "workers_per_rank": args.workers, "results": results,
                      "ratios": {k: round(v, 3) for k, v in ratios.items()}}))


def over_limit(args, workdir: Path, server) -> None:
    """``--over-limit``: the split is twice the node cache (docs/caching.md). From the local S3 server, 2 ranks of
    one node sharing one cache folder, ``OVER_LIMIT_EPOCHS`` epochs each of: no cache; a limit of half the split with
    eviction by next use and with LRU; a limit of the whole split. Bytes fetched (``FETCH_STATS``: every GET's body)
    per epoch against the split, and the rate of the epochs after the first against no cache."""
    files, _, url, tars, weed_files = packed_on_s3(args, workdir, server)
    split = sum(p.stat().st_size for p in tars)
    configs = {"no_cache": None,
               "next_use": shards.ShardCache(workdir / "cache-next-use", limit=split // 2),
               "lru": shards.ShardCache(workdir / "cache-lru", limit=split // 2, eviction="lru"),
               "fits": shards.ShardCache(workdir / "cache-fits", limit=split)}
    results = {name: run_config(name, url, cache, args, weed_files, epochs=OVER_LIMIT_EPOCHS)
               for name, cache in configs.items()}

    def later_rate(name: str) -> float:
        rates = results[name]["epoch_img_per_s"][1:]
        return sum(rates) / len(rates)

    ratios = {}
    for name in configs:
        per_epoch = [f / split for f in results[name]["fetched_per_epoch"]]
        ratios[f"{name}_fetched_per_epoch_vs_split"] = [round(r, 3) for r in per_epoch]
        # After the first epoch, which fetches the split once: shards a rank fetched for a neighbour's epoch count
        # in the epoch they crossed the network, so the mean over epochs 2-4 is the measure, not each epoch.
        ratios[f"{name}_later_epochs_fetched_vs_split"] = round((sum(per_epoch) - 1) / (len(per_epoch) - 1), 3)
        ratios[f"{name}_later_epochs_rate_vs_no_cache"] = round(later_rate(name) / later_rate("no_cache"), 3)
    ratios["fits_fetched_vs_split_all_epochs"] = round(results["fits"]["fetched_bytes"] / split, 3)
    log.info("limit = half the split: epochs 2-%d fetched %.3fx the split per epoch by next use (goal <= 0.55), "
             "%.3fx with LRU, %.3fx without a cache; their rate %.2fx / %.2fx the no-cache rate (goal >= 1); "
             "limit = the split: %.3fx over all epochs (goal 1.000)", OVER_LIMIT_EPOCHS,
             ratios["next_use_later_epochs_fetched_vs_split"], ratios["lru_later_epochs_fetched_vs_split"],
             ratios["no_cache_later_epochs_fetched_vs_split"], ratios["next_use_later_epochs_rate_vs_no_cache"],
             ratios["lru_later_epochs_rate_vs_no_cache"], ratios["fits_fetched_vs_split_all_epochs"])
    print(json.dumps({"images": len(files), "shards": len(tars), "split_bytes": split, "ranks": 2,
                      "workers_per_rank": args.workers, "epochs": OVER_LIMIT_EPOCHS, "results": results,
                      "ratios": ratios}))


if __name__ == "__main__":
    main()
