#!/usr/bin/env python
"""Benchmark pack-shards against the raw-copy bound: ``tar -cf`` over the same files, in the same run.

Generates an ImageNet-like corpus (~500x375 JPEGs of smooth shapes plus grain, ~10 classes), times ``tar -cf``,
then packs it with ``--verify header`` and ``--verify full`` and prints files/s, MB/s and the ratio to tar. The page
cache is warm for every contender (the corpus was just written), so this measures CPU cost, not the disk.
Progress goes to stderr; the last line on stdout is one JSON object with every number.

    .venv/bin/python scripts/bench/pack.py            # 3000 files
    .venv/bin/python scripts/bench/pack.py --quick    # 400 files

``--adopt`` measures adopting WebDataset tars in place instead: the same corpus written as tars by
``webdataset.TarWriter`` (``jpg`` and ``cls`` members, 250 samples a tar), then ``shards index`` against
``pack-shards --label-member cls`` (``--verify header`` and ``full``, one process each) on those tars, rounds
interleaved (every other round reversed), best of each; the index's bytes on disk as a share of the tars'; and the
adopted dataset streamed against the packed one (I/O only, 5 epochs a pass, and one epoch of the fast pipeline's
uint8 batches), the same samples, rounds interleaved, best rate of each, page cache warm. Goals (issue 37): index
>= 5x as fast as packing, index < 2% of the source, streaming the adopted dataset >= 0.95x the packed one.

    .venv/bin/python scripts/bench/pack.py --adopt [--quick] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from preprocess.pack.packer import PackConfig, pack  # noqa: E402
from preprocess.pack.sources.members import SourceFields  # noqa: E402

PER_TAR = 250  # samples per WebDataset tar of the --adopt source
IO_EPOCHS = 5  # epochs per I/O-only streaming pass


def make_image(rng: np.random.Generator, width: int = 500, height: int = 375) -> bytes:
    """Low-frequency colour fields plus fine grain: compresses like a photo (~40-120 kB at quality 90)."""
    coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    grain = rng.normal(0, 18, (height, width, 3))
    pixels = np.clip(base + grain, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def make_corpus(root: Path, files: int, classes: int, seed: int) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    total = 0
    for i in range(files):
        folder = root / f"class_{i % classes:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        data = make_image(rng)
        (folder / f"n{i:07d}.JPEG").write_bytes(data)
        total += len(data)
    return files, total


def timed(label: str, func) -> float:
    start = time.perf_counter()
    func()
    seconds = time.perf_counter() - start
    print(f"  {label}: {seconds:.2f} s", file=sys.stderr)
    return seconds


def row(name: str, files: int, nbytes: int, seconds: float, tar_seconds: float) -> dict:
    return {"name": name, "seconds": round(seconds, 3), "files_per_s": round(files / seconds, 1),
            "mb_per_s": round(nbytes / seconds / 1e6, 1), "time_vs_tar": round(seconds / tar_seconds, 2)}


# -- --adopt: shards index against pack-shards on the same WebDataset tars ------------------------------------------
def make_wds_source(folder: Path, files: int, classes: int, seed: int) -> tuple[str, int]:
    """``files`` JPEGs as WebDataset tars (``<key>.jpg``, ``<key>.cls`` = the class name) written by webdataset
    itself; the brace pattern naming them and their bytes on disk."""
    import webdataset as wds

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    tars = (files + PER_TAR - 1) // PER_TAR
    for t in range(tars):
        with wds.TarWriter(str(folder / f"part-{t:04d}.tar")) as sink:
            for i in range(t * PER_TAR, min(files, (t + 1) * PER_TAR)):
                sink.write({"__key__": f"n{i:07d}", "jpg": make_image(rng),
                            "cls": f"class_{i % classes:03d}".encode()})
    return str(folder / f"part-{{0000..{tars - 1:04d}}}.tar"), folder_bytes(folder)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def index_function():
    """``shards index``'s library function, or a clear exit when this tree does not have it yet."""
    try:
        from preprocess.adopt.index import index_tars
    except ImportError as exc:
        sys.exit(f"--adopt needs shards index (preprocess.adopt.index.index_tars, issue 37): {exc}")
    return index_tars


def interleaved(contenders: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each contender per round, every other round in reverse order (a slot in the round moves a rate
    on a shared machine: see scripts/bench/loader.py ``alternating_rounds``)."""
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name in (list(contenders) if r % 2 == 0 else list(reversed(contenders))):
            seconds[name].append(timed(f"{name} (round {r + 1})", contenders[name]))
    return seconds


def fresh(folder: Path, run) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    run()


class ByteCount:
    """A decoder that does no decoding: the I/O-only passes (as in scripts/bench/loader.py)."""

    def __call__(self, sample, seed: int) -> int:
        return len(sample.data)


def stream_rate(open_dataset, fast: bool, workers: int, samples: int, epochs: int, batch_size: int = 64) -> float:
    """Images/s over ``epochs`` epochs: uint8 batches of the fast pipeline, or byte counts (I/O only: an epoch of a
    few thousand samples is over in a fraction of a second, so several make a pass longer than worker start-up)."""
    import shards
    from shards.image.transforms import TransformSpec
    from shards.loader.loader import workers_mode

    if fast:
        dataset = open_dataset(transform=TransformSpec(preset="eval", size=224, resize_size=256),
                               decode=shards.Decode("fast"), seed=0)
    else:
        dataset = open_dataset(decode=shards.Decode(decoder=ByteCount()), seed=0)
    loader = shards.make_loader(dataset, batch_size=batch_size, mode=workers_mode(workers, persistent=False),
                                drop_last=False, stage_times=False)
    start, seen = time.perf_counter(), 0
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            seen += len(batch[1])
    elapsed = time.perf_counter() - start
    if seen != samples * epochs:
        raise RuntimeError(f"saw {seen} images, expected {samples * epochs}")
    return seen / elapsed


def adopt_bench(workdir: Path, files: int, rounds: int, workers: int) -> dict:
    import shards

    index_tars = index_function()
    print(f"writing {files} JPEGs as WebDataset tars", file=sys.stderr)
    pattern, source_bytes = make_wds_source(workdir / "wds", files, classes=10, seed=0)
    print(f"source: {pattern}, {source_bytes / 1e6:.1f} MB", file=sys.stderr)
    index_out, packed = workdir / "index", {v: workdir / f"packed-{v}" for v in ("header", "full")}
    fields = SourceFields(label_member="cls")
    reports = []  # each run's report; the last names the base the tars are read from
    contenders = {"shards index": lambda: fresh(index_out, lambda: reports.append(
        index_tars(pattern, str(index_out), label_member="cls", quiet=True)))}
    for verify, out in packed.items():
        cfg = PackConfig(pattern, str(out), verify=verify, workers=1, quiet=True, source_fields=fields)
        contenders[f"pack-shards --verify {verify}"] = lambda cfg=cfg, out=out: fresh(out, lambda: pack(cfg))
    seconds = interleaved(contenders, rounds)
    best = {name: min(values) for name, values in seconds.items()}
    index_bytes = folder_bytes(index_out)
    report = reports[-1]
    if report.samples.get("train") != files or report.rejected:
        raise RuntimeError(f"shards index kept {report.samples} of {files} samples ({report.rejected} refused)")

    def adopted(**options):
        return shards.open_dataset(str(index_out), "train", remote=shards.Remote(base_url=report.source_base),
                                   **options)

    def packed_header(**options):
        return shards.open_dataset(str(packed["header"]), "train", **options)

    passes = {f"{kind} {mode}": (lambda open_dataset=open_dataset, fast=(mode == "fast"):
                                 stream_rate(open_dataset, fast, workers, files, epochs=1 if fast else IO_EPOCHS))
              for mode in ("io_only", "fast") for kind, open_dataset in (("adopted", adopted),
                                                                         ("packed", packed_header))}
    rates: dict[str, list[float]] = {name: [] for name in passes}
    for r in range(rounds):
        for name in (list(passes) if r % 2 == 0 else list(reversed(passes))):
            rates[name].append(passes[name]())
            print(f"  stream {name} (round {r + 1}): {rates[name][-1]:.0f} img/s", file=sys.stderr)
    stream = {name: max(values) for name, values in rates.items()}
    return {
        "bench": "pack_adopt", "files": files, "source_bytes": source_bytes, "rounds": rounds, "workers": workers,
        "seconds": {name: [round(v, 3) for v in values] for name, values in seconds.items()},
        "best_seconds": {name: round(v, 3) for name, v in best.items()},
        "index_speed_vs_pack": {verify: round(best[f"pack-shards --verify {verify}"] / best["shards index"], 2)
                                for verify in packed},
        "index_bytes": index_bytes, "index_share_of_source": round(index_bytes / source_bytes, 5),
        "stream_images_per_s": {name: round(v, 1) for name, v in stream.items()},
        "stream_rounds": {name: [round(v, 1) for v in values] for name, values in rates.items()},
        "stream_adopted_vs_packed": {mode: round(stream[f"adopted {mode}"] / stream[f"packed {mode}"], 3)
                                     for mode in ("io_only", "fast")},
    }


def print_adopt(result: dict) -> None:
    for name, seconds in result["best_seconds"].items():
        print(f"{name:30}{seconds:>9.2f} s  {result['files'] / seconds:>9.1f} files/s", file=sys.stderr)
    speed = result["index_speed_vs_pack"]
    print(f"index vs pack: {speed['header']}x (--verify header), {speed['full']}x (--verify full); goal >= 5x",
          file=sys.stderr)
    print(f"index on disk: {result['index_bytes']:,} bytes, {100 * result['index_share_of_source']:.3f}% of the "
          f"source; goal < 2%", file=sys.stderr)
    for mode, ratio in result["stream_adopted_vs_packed"].items():
        print(f"stream {mode}: adopted {result['stream_images_per_s'][f'adopted {mode}']} img/s, packed "
              f"{result['stream_images_per_s'][f'packed {mode}']} img/s: {ratio}x; goal >= 0.95x", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="400 files instead of 3000")
    parser.add_argument("--files", type=int, default=None)
    parser.add_argument("--workers", type=int, default=1,
                        help="pack-shards' workers; with --adopt the streaming passes' DataLoader workers (both "
                             "shards index and pack-shards then run in one process)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to build the corpus (default: a temp dir)")
    parser.add_argument("--adopt", action="store_true",
                        help="shards index against pack-shards on WebDataset tars, and streaming both")
    parser.add_argument("--rounds", type=int, default=3, help="--adopt: interleaved rounds (best of each)")
    args = parser.parse_args()
    files = args.files or (400 if args.quick else 3000)
    workdir = Path(tempfile.mkdtemp(prefix="shardcache-bench-", dir=args.workdir))
    try:
        if args.adopt:
            result = adopt_bench(workdir, files, args.rounds, args.workers)
            print_adopt(result)
            print(json.dumps(result, sort_keys=True))
            return
        source = workdir / "src"
        print(f"generating {files} JPEGs in {source}", file=sys.stderr)
        files, nbytes = make_corpus(source, files, classes=10, seed=0)
        print(f"corpus: {files} files, {nbytes / 1e6:.1f} MB", file=sys.stderr)
        results = []
        tar_s = timed("tar -cf", lambda: subprocess.run(["tar", "-cf", str(workdir / "copy.tar"), "-C", str(source),
                                                         "."], check=True))
        results.append(row("tar -cf", files, nbytes, tar_s, tar_s))
        for verify in ("header", "full"):
            cfg = PackConfig(str(source), str(workdir / f"out-{verify}"), verify=verify, workers=args.workers,
                             quiet=True)
            seconds = timed(f"pack-shards --verify {verify} --workers {args.workers}", lambda: pack(cfg))
            results.append(row(f"pack-shards --verify {verify}", files, nbytes, seconds, tar_s))
        print(f"{'':34}{'files/s':>10}{'MB/s':>10}{'time vs tar':>14}")
        for r in results:
            print(f"{r['name']:34}{r['files_per_s']:>10}{r['mb_per_s']:>10}{r['time_vs_tar']:>13}x")
        print(json.dumps({"bench": "pack", "files": files, "bytes": nbytes, "workers": args.workers,
                          "results": results}, sort_keys=True))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
