"""Benchmark: images/s of shardcache's readers (standard and fast path) against ImageFolder and webdataset, cold cache.

One generated corpus of ImageNet-like JPEGs (about 500x375, ~100 KB) is packed into tar and HDF5 shards. Every
decoding pass ends in the same thing on the consumer: normalised float [B, 3, 224, 224] batches from the eval
transform (Resize 256, CenterCrop 224). The peers and shardcache's standard path normalise in the workers; the
fast path ships uint8 and runs ``Normalize`` per batch in the main process, inside the timed loop (``fast_tar``;
``fast_tar_1thread`` does it with one intra-op thread, ``fast_tar_uint8`` not at all, standing in for a GPU
consumer where normalising costs the CPU nothing). Same batch size
and worker count everywhere, and each pass first drops the page cache of its data files
(``posix_fadvise(DONTNEED)`` per file). The fast path also runs with simplejpeg switched off (PIL decoding) to see
whether simplejpeg earns its dependency. I/O-only passes replace decoding by counting bytes; single-core rates
(decode only with PIL and simplejpeg, and decode plus transform) are the per-core ceilings. An accuracy check
compares the fast eval path's uint8 pixels and a seeded random resnet18's features with torchvision's reference.
The fast path also runs with its per-stage timing switched off (``make_loader(stage_times=False)``): the ratio is
what measuring read/decode/transform/collate seconds costs, and a clock-only loop prices it per sample without noise.
``--watchdog`` prices stall recovery the same way: the fast path with and without
``make_loader(stall=StallPolicy(...))`` (workers publish each sample they decode; the main process waits for batches
in short polls), side by side, and a loop that publishes and clears a sample prices it per sample.

    python scripts/bench/loader.py --repeat 3   # 3000 images, ~3.5 minutes on 2 cores
    python scripts/bench/loader.py --quick --repeat 3   # 600 images, ~70 s
    python scripts/bench/loader.py --stage-times-only --repeat 5   # only what stage timing costs
    python scripts/bench/loader.py --watchdog --quick --repeat 4   # only what the stall watchdog costs
    python scripts/bench/loader.py --modes --repeat 3   # run modes against the peers, SPDL included (~12 min)
    python scripts/bench/loader.py --audit --quick --repeat 4   # what the resume audit costs per save and resume

``--audit`` (``scripts/bench/loader_audit.py``): the resume audit's cost per ``state_dict`` and per
``load_state_dict`` (ms, and as a share of a step), per sample in the workers, and on throughput, beside the audit
off.

``--modes`` (``scripts/bench/loader_modes.py``) runs every pass in a fresh process: the fast path in each run mode
(worker processes, threads, threads inside a process, ``Auto``), the standard path in processes and threads, and the
peers (ImageFolder, webdataset, SPDL over files and over tars), with img/s, CPU per image and peak memory.

Progress and the table go to stderr; stdout gets one JSON line with ``images_per_s``, ``fast_vs_best_peer``, the
ratios and the accuracy numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import webdataset as wds
import torchvision.transforms as T
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.models import resnet18

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import shards  # noqa: E402
from shards.image import fast  # noqa: E402
from shards.image.decode import decode_image  # noqa: E402
from shards.image.fast import FastDecoder  # noqa: E402
from shards.manifest import DatasetManifest, ShardInfo, SplitInfo  # noqa: E402
from shards.provenance import SourceInfo  # noqa: E402
from shards.jobs.progress import setup_logging  # noqa: E402
from shards.formats.sample import RawSample  # noqa: E402
from shards.transport.storage import get_storage, shard_name  # noqa: E402
from shards.image.transforms import TransformSpec, build_transform  # noqa: E402
from shards.procs.stage_times import SharedStageTimes, StageTally  # noqa: E402
from shards.procs.worker_status import WorkerStatus  # noqa: E402
from shards.loader.loader import workers_mode  # noqa: E402
from shards.loader.watchdog import StallPolicy  # noqa: E402

# Every library is imported above, before any timed pass, so no loader pays another's import time.

log = logging.getLogger("bench.loader")
CLASSES = [f"class{i:02d}" for i in range(10)]
SPEC = TransformSpec(preset="eval", size=224)
# Draft decoding only helps when the stored JPEG is at least twice the transform's input: 500x375 against
# Resize(256) is not, so the draft gain is measured a second time at a small input size where it applies.
SMALL_SPEC = TransformSpec(preset="eval", size=112)


PEERS = ("imagefolder", "webdataset", "shardcache_tar", "shardcache_hdf5")
NOT_FLOAT = ("fast_tar_uint8", "io_imagefolder", "io_webdataset", "io_shardcache_tar", "io_shardcache_hdf5",
             "io_shardcache_tar_nosha256")


# -- corpus --------------------------------------------------------------------------------------------------------
def make_jpeg(rng: np.random.Generator, width: int = 500, height: int = 375) -> bytes:
    """Smooth colour fields plus grain: compresses like a photo (~100 KB at 500x375, quality 90)."""
    small = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    pixels = np.asarray(small, dtype=np.float32) + rng.normal(0, 16, (height, width, 3)).astype(np.float32)
    buffer = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def build_corpus(folder: Path, count: int, *, classes: list[str] = CLASSES,
                 size: tuple[int, int] = (500, 375)) -> list[Path]:
    """``count`` JPEGs in an ImageFolder tree, round robin over ``classes``; kept between runs by a marker."""
    marker = folder / f".complete-{count}"
    files = [folder / classes[i % len(classes)] / f"img_{i:06d}.jpg" for i in range(count)]
    if marker.exists():
        return files
    rng = np.random.default_rng(0)
    for name in classes:
        (folder / name).mkdir(parents=True, exist_ok=True)
    for path in files:
        path.write_bytes(make_jpeg(rng, *size))
    marker.touch()
    return files


def pack(files: list[Path], out: Path, storage: str, per_shard: int) -> None:
    """Shards in a shuffled order (as pack-shards writes them), with the storage writers directly."""
    if (out / "dataset.json").exists():
        return
    out.mkdir(parents=True, exist_ok=True)
    order = np.random.default_rng(1).permutation(len(files))
    writer_type = get_storage(storage).writer
    classes = sorted({path.parent.name for path in files})  # the corpus's own classes (build_corpus(classes=))
    infos, counts = [], [0] * len(classes)
    for index, first in enumerate(range(0, len(files), per_shard)):
        name = shard_name("train", index, storage)
        with writer_type(out / name, classes=classes) as writer:
            for i in order[first:first + per_shard]:
                path = files[i]
                label = classes.index(path.parent.name)
                meta = json.dumps({"path": f"{path.parent.name}/{path.name}", "class": path.parent.name}).encode()
                writer.write(RawSample(f"{path.parent.name}_{path.stem}", path.read_bytes(), "jpg", label, meta))
                counts[label] += 1
        infos.append(ShardInfo(name, writer.samples, writer.bytes, writer.sha256))
    split = SplitInfo(len(files), tuple(counts), tuple(infos))
    DatasetManifest(storage=storage, classes=tuple(classes), splits={"train": split},
                    source=SourceInfo("imagefolder", str(files[0].parents[1]), len(files)),
                    packing={"seed": 1, "max_samples": per_shard}).save(out)


def drop_cache(paths: Iterable[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- loaders -------------------------------------------------------------------------------------------------------
class ByteCount:
    """A decoder that does no decoding: the I/O-only passes."""

    def __call__(self, sample, seed: int) -> int:
        return len(sample.data)


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def imagefolder(root: Path, args, io_only: bool):
    if io_only:
        dataset = ImageFolder(str(root), loader=read_bytes, transform=len)
    else:
        dataset = ImageFolder(str(root), transform=build_transform(SPEC))
    return torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                                       generator=torch.Generator().manual_seed(0))


def webdataset_loader(folder: Path, args, io_only: bool):
    urls = sorted(str(p) for p in folder.glob("*.tar"))
    pipeline = wds.WebDataset(urls, shardshuffle=False, empty_check=False).shuffle(512)
    if io_only:
        pipeline = pipeline.to_tuple("jpg", "cls").map_tuple(len, lambda c: int(c))
    else:
        transform = build_transform(SPEC)
        pipeline = pipeline.decode("pil").to_tuple("jpg", "cls").map_tuple(transform, int)
    return wds.WebLoader(pipeline.batched(args.batch_size), batch_size=None, num_workers=args.workers)


def shardcache_loader(folder: Path, args, io_only: bool, draft: bool = False, spec: TransformSpec = SPEC,
                      verify_sha256: bool = True, stage_times: bool = True):
    if io_only:
        dataset = shards.open_dataset(folder, decode=shards.Decode(decoder=ByteCount()), seed=0)
    else:
        dataset = shards.open_dataset(folder, transform=spec, decode=shards.Decode(draft=draft), seed=0)
    dataset.verify_sha256 = verify_sha256
    return shards.make_loader(dataset, batch_size=args.batch_size, mode=workers_mode(args.workers, persistent=False),
                              drop_last=False, stage_times=stage_times)


def _check_decoder(expect_simplejpeg: bool, confirmed, worker_id: int) -> None:
    """Runs in each worker: proves the parent's simplejpeg switch reached the forked copy of ``shards.image.fast``."""
    if (fast.simplejpeg is not None) != expect_simplejpeg:
        raise RuntimeError(f"worker {worker_id}: simplejpeg is {'on' if fast.simplejpeg else 'off'}, "
                           f"expected {'on' if expect_simplejpeg else 'off'}")
    with confirmed.get_lock():
        confirmed.value += 1


@contextlib.contextmanager
def simplejpeg_switch(enabled: bool) -> Iterator[None]:
    """``shards.image.fast`` decodes with PIL inside the block when ``enabled`` is False; workers forked inside inherit
    the module as it is then, so the switch reaches them too."""
    saved = fast.simplejpeg
    fast.simplejpeg = saved if enabled else None
    try:
        yield
    finally:
        fast.simplejpeg = saved


def fast_batches(folder: Path, args, use_simplejpeg: bool = True, consumer: str = "normalize",
                 verify_sha256: bool = True, stage_times: bool = True, stall_timeout: float | None = None,
                 resume_audit: str = "refuse") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The fast path as a consumer sees it: uint8 batches from the workers, normalised here, per batch.

    ``consumer``: ``normalize`` (torch's default intra-op threads), ``normalize_1thread`` (one thread, so idle
    OpenMP threads do not spin on the cores the workers decode on), ``uint8`` (no normalisation here: a proxy for a
    GPU consumer, where the per-batch Normalize costs the CPU nothing).
    """
    dataset = shards.open_dataset(folder, transform=SPEC, decode=shards.Decode("fast"), seed=0)
    dataset.verify_sha256 = verify_sha256
    normalize = dataset.normalizer() if consumer != "uint8" else torch.nn.Identity()
    confirmed = multiprocessing.Value("i", 0)
    check = functools.partial(_check_decoder, use_simplejpeg and fast.simplejpeg is not None, confirmed)
    loader = shards.make_loader(dataset, batch_size=args.batch_size, mode=workers_mode(args.workers, persistent=False),
                                drop_last=False, worker_init_fn=check if args.workers > 0 else None,
                                stage_times=stage_times,
                                stall=None if stall_timeout is None else StallPolicy(stall_timeout),
                                resume_audit=resume_audit)
    threads = torch.get_num_threads()
    if consumer == "normalize_1thread":
        torch.set_num_threads(1)
    try:
        with simplejpeg_switch(use_simplejpeg):
            for images, labels in loader:
                yield normalize(images), labels
    finally:
        torch.set_num_threads(threads)
    if args.workers > 0 and confirmed.value != args.workers:
        raise RuntimeError(f"only {confirmed.value} of {args.workers} workers confirmed the decoder setting")
    if stage_times:
        log.info("worker seconds by stage: %s",
                  ", ".join(f"{k} {v:.2f}" for k, v in loader.stage_seconds().items()))


def timed_pass(name: str, make: Callable, files: list[Path], expected: int) -> float:
    drop_cache(files)
    start = time.perf_counter()
    seen = 0
    for batch in make():
        if not seen and name not in NOT_FLOAT and not batch[0].is_floating_point():
            raise RuntimeError(f"{name}: the consumer got {batch[0].dtype} batches, not normalised floats")
        seen += len(batch[1])
    elapsed = time.perf_counter() - start
    if seen != expected:
        raise RuntimeError(f"{name}: saw {seen} images, expected {expected}")
    log.info("%-26s %8.1f img/s  (%d images in %.1f s)", name, seen / elapsed, seen, elapsed)
    return seen / elapsed


def best_of_rounds(passes: dict, expected: int, repeat: int) -> dict[str, float]:
    """Every loader once per round, rounds repeated, best rate kept: on a shared machine other load only ever
    slows a pass down, and interleaving spreads it over all loaders instead of hitting one."""
    rates: dict[str, float] = {}
    for _ in range(repeat):
        for name, (make, paths) in passes.items():
            rates[name] = max(rates.get(name, 0.0), timed_pass(name, make, paths, expected))
    return rates


def alternating_rounds(passes: dict, expected: int, repeat: int) -> dict[str, list[float]]:
    """Every loader once per round, every other round in reverse order, so no pass always follows the same one
    (on a shared 2-core machine a pass's slot in the round moved its rate by ~10%); each pass's rate per round."""
    rates: dict[str, list[float]] = {name: [] for name in passes}
    for round_index in range(repeat):
        names = list(passes) if round_index % 2 == 0 else list(reversed(passes))
        for name in names:
            make, paths = passes[name]
            rates[name].append(timed_pass(name, make, paths, expected))
    return rates


def _rate(function: Callable, items: list) -> float:
    start = time.perf_counter()
    for item in items:
        function(item)
    return len(items) / (time.perf_counter() - start)


def single_core(files: list[Path], limit: int) -> dict[str, float]:
    """Per-core ceilings, page cache warm: decode only (PIL, simplejpeg), decode + standard transform (what a
    standard worker does per image), and the fast path's decode + resize/crop to uint8 (simplejpeg, PIL)."""
    blobs = [p.read_bytes() for p in files[:limit]]
    transform = build_transform(SPEC)
    samples = [RawSample(str(i), data, "jpg", 0, b"") for i, data in enumerate(blobs)]
    decoder = FastDecoder(SPEC)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core, as in a DataLoader worker (torch sets one thread there)
    try:
        rates = {"decode_pil_1core": _rate(lambda data: Image.open(io.BytesIO(data)).load(), blobs)}
        if fast.simplejpeg is not None:
            rates["decode_simplejpeg_1core"] = _rate(
                lambda data: fast.simplejpeg.decode_jpeg(data, colorspace="RGB"), blobs)
        rates["decode_transform_1core"] = _rate(lambda data: transform(decode_image(data)), blobs)
        rates["fast_eval_1core"] = _rate(lambda sample: decoder(sample, 0), samples)
        with simplejpeg_switch(False):
            rates["fast_eval_pil_1core"] = _rate(lambda sample: decoder(sample, 0), samples)
    finally:
        torch.set_num_threads(threads)
    return rates


def fast_accuracy(files: list[Path], limit: int) -> dict[str, float]:
    """The fast eval path against torchvision's Resize(256) + CenterCrop(224) on the PIL-decoded image.

    Pixels: mean absolute difference of the uint8 images in gray levels (mean and max over images). Features: the
    cosine between a seeded, randomly initialised resnet18's penultimate features of the two inputs (min over
    images). Both with simplejpeg (when present) and with PIL as the fast path's decoder.
    """
    reference = T.Compose([T.Resize(SPEC.eval_resize), T.CenterCrop(SPEC.size), T.PILToTensor()])
    decoder = FastDecoder(SPEC)
    blobs = [p.read_bytes() for p in files[:limit]]
    expected = torch.stack([reference(decode_image(data)) for data in blobs])
    torch.manual_seed(0)
    model = resnet18(weights=None, num_classes=10)
    model.fc = torch.nn.Identity()
    model.eval()
    normalize = decoder.normalizer()
    with torch.no_grad():
        expected_features = model(normalize(expected))
    result = {}
    for label, use_simplejpeg in (("simplejpeg", True), ("pil", False)):
        if use_simplejpeg and fast.simplejpeg is None:
            continue
        with simplejpeg_switch(use_simplejpeg):
            got = torch.stack([decoder(RawSample(str(i), data, "jpg", 0, b""), 0) for i, data in enumerate(blobs)])
        per_image = (got.float() - expected.float()).abs().mean(dim=(1, 2, 3))
        with torch.no_grad():
            cosine = torch.nn.functional.cosine_similarity(model(normalize(got)), expected_features, dim=1)
        result[label] = {"images": len(blobs), "mean_abs_diff_gray": round(float(per_image.mean()), 4),
                         "max_abs_diff_gray": round(float(per_image.max()), 4),
                         "min_feature_cosine": round(float(cosine.min()), 6)}
    return result


def draft_difference(files: list[Path], limit: int, spec: TransformSpec) -> float:
    """Mean absolute difference, in 8-bit gray levels, between eval inputs decoded fully and with draft."""
    transform = build_transform(spec)
    std = torch.tensor(spec.std)[:, None, None]
    diffs = []
    for path in files[:limit]:
        data = path.read_bytes()
        full = transform(decode_image(data))
        drafted = transform(decode_image(data, draft_size=spec.draft_size))
        diffs.append(float(((full - drafted) * std * 255).abs().mean()))
    return float(np.mean(diffs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="600 images: a smoke run under three minutes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--per-shard", type=int, default=500)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the corpus here between runs")
    parser.add_argument("--repeat", type=int, default=1, help="rounds over all loaders; each loader's best counts")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--sha256-only", action="store_true",
                        help="only measure what hashing whole tar shards while streaming costs (I/O-only and fast)")
    parser.add_argument("--watchdog", action="store_true",
                        help="only measure what the stall watchdog (make_loader(stall=StallPolicy(...))) costs, "
                             "fast path")
    parser.add_argument("--modes", action="store_true",
                        help="only the run modes against the peers, SPDL included: img/s, CPU per image, peak "
                             "memory, each pass in a fresh process (scripts/bench/loader_modes.py)")
    parser.add_argument("--passes", default=None,
                        help="--modes: only these passes, comma-separated (the ratios their results allow; default: "
                             "all; fast_auto0_uint8, Auto without its runoff, and fast_autowide_uint8 / "
                             "fast_autowidenocut_uint8, Auto over half the workers with and without its cut, only "
                             "when named)")
    parser.add_argument("--audit", action="store_true",
                        help="only measure what the resume audit costs per save and per resume (ms, share of a "
                             "step), per sample and on throughput, beside the audit off")
    parser.add_argument("--stage-times-only", action="store_true",
                        help="only measure what per-stage timing costs (fast and standard paths, with and without)")
    args = parser.parse_args()
    setup_logging(quiet=args.quiet)
    count = 600 if args.quick else args.images
    per_shard = 150 if args.quick else args.per_shard
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="shardcache-bench-"))
    try:
        run(args, workdir, count, per_shard)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def loader_passes(args, workdir: Path, files: list[Path], tars: list[Path], h5s: list[Path]) -> dict:
    tar, hdf5 = workdir / "tar", workdir / "hdf5"
    return {
        "imagefolder": (lambda: imagefolder(workdir / "images", args, False), files),
        "webdataset": (lambda: webdataset_loader(tar, args, False), tars),
        "shardcache_tar": (lambda: shardcache_loader(tar, args, False), tars),
        "shardcache_hdf5": (lambda: shardcache_loader(hdf5, args, False), h5s),
        "fast_tar": (lambda: fast_batches(tar, args), tars),
        "fast_hdf5": (lambda: fast_batches(hdf5, args), h5s),
        "fast_tar_pil": (lambda: fast_batches(tar, args, use_simplejpeg=False), tars),
        "fast_tar_1thread": (lambda: fast_batches(tar, args, consumer="normalize_1thread"), tars),
        "fast_tar_uint8": (lambda: fast_batches(tar, args, consumer="uint8"), tars),
        "shardcache_tar_draft": (lambda: shardcache_loader(tar, args, False, draft=True), tars),
        "shardcache_tar_112": (lambda: shardcache_loader(tar, args, False, spec=SMALL_SPEC), tars),
        "shardcache_tar_112_draft": (lambda: shardcache_loader(tar, args, False, draft=True, spec=SMALL_SPEC), tars),
        "io_imagefolder": (lambda: imagefolder(workdir / "images", args, True), files),
        "io_webdataset": (lambda: webdataset_loader(tar, args, True), tars),
        "io_shardcache_tar": (lambda: shardcache_loader(tar, args, True), tars),
        "io_shardcache_hdf5": (lambda: shardcache_loader(hdf5, args, True), h5s),
    }


def sha256_passes(args, workdir: Path, tars: list[Path]) -> dict:
    """Tar shards read whole are hashed and checked against dataset.json while streaming; these passes price it."""
    tar = workdir / "tar"
    return {
        "io_shardcache_tar": (lambda: shardcache_loader(tar, args, True), tars),
        "io_shardcache_tar_nosha256": (lambda: shardcache_loader(tar, args, True, verify_sha256=False), tars),
        "fast_tar": (lambda: fast_batches(tar, args), tars),
        "fast_tar_nosha256": (lambda: fast_batches(tar, args, verify_sha256=False), tars),
    }


def stage_time_passes(args, workdir: Path, tars: list[Path]) -> dict:
    """The fast and standard paths with and without per-stage timing, interleaved in the same rounds."""
    tar = workdir / "tar"
    return {
        "fast_tar": (lambda: fast_batches(tar, args), tars),
        "fast_tar_nostagetimes": (lambda: fast_batches(tar, args, stage_times=False), tars),
        "shardcache_tar": (lambda: shardcache_loader(tar, args, False), tars),
        "shardcache_tar_nostagetimes": (lambda: shardcache_loader(tar, args, False, stage_times=False), tars),
    }


def watchdog_passes(args, workdir: Path, tars: list[Path]) -> dict:
    """The fast path with and without stall recovery, interleaved in the same rounds."""
    tar = workdir / "tar"
    return {
        "fast_tar": (lambda: fast_batches(tar, args), tars),
        "fast_tar_watchdog": (lambda: fast_batches(tar, args, stall_timeout=600.0), tars),
    }


def watchdog_us_per_sample(samples: int = 200_000) -> float:
    """What a worker adds per sample under the watchdog (publish the sample, mark itself idle), without noise
    from loading: a loop over ready items with and without it, best of three."""
    keys = [f"n{i:08d}" for i in range(samples)]
    slot = WorkerStatus().slot(0)

    def plain() -> None:
        for _ in keys:
            pass

    def watched() -> None:
        for row, key in enumerate(keys):
            slot.working(row, key)
            slot.idle()

    runs = {}
    for name, function in (("plain", plain), ("watched", watched)):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            function()
            times.append(time.perf_counter() - start)
        runs[name] = min(times)
    return (runs["watched"] - runs["plain"]) / samples * 1e6


def stage_time_costs(rates: dict[str, float]) -> dict[str, float]:
    """Share of throughput lost to stage timing, best rate against best rate (negative: within noise)."""
    return {name: 1 - rates[name] / rates[f"{name}_nostagetimes"] for name in ("fast_tar", "shardcache_tar")
            if f"{name}_nostagetimes" in rates}


def stage_timing_us_per_sample(samples: int = 200_000) -> float:
    """What the timing adds per sample (read wrapper, decode split, a flush per batch of 64), without noise from
    loading: a loop over ready items with and without it, best of three."""
    items = [(None, None)] * samples

    def plain() -> None:
        for _ in items:
            pass

    def timed() -> None:
        tally = StageTally(SharedStageTimes(), 64, slot=0)
        clock = time.perf_counter
        for _ in tally.timed_read(items):
            began = clock()
            tally.decoded(began, clock(), clock())
        tally.flush()

    def best(function: Callable[[], None]) -> float:
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            function()
            runs.append(time.perf_counter() - start)
        return min(runs)

    return (best(timed) - best(plain)) / samples * 1e6


def stage_times_report(rates: dict[str, float], costs: dict[str, float], per_sample_us: float) -> str:
    lines = [f"stage timing costs {name} {cost:.2%} of throughput ({rates[name]:.1f} vs "
             f"{rates[name + '_nostagetimes']:.1f} img/s without, best of rounds)" for name, cost in costs.items()]
    per_image_ms = 1000 / rates["fast_eval_1core"] if "fast_eval_1core" in rates else None
    share = f", {per_sample_us / 1000 / per_image_ms:.3%} of a fast-path image on one core" if per_image_ms else ""
    lines.append(f"stage timing adds {per_sample_us:.2f} us per sample{share}")
    return "\n".join(lines)


def sha256_costs(rates: dict[str, float]) -> dict[str, float]:
    """Share of throughput lost to the streaming sha256 check (negative: within noise)."""
    return {name: 1 - rates[name] / rates[f"{name}_nosha256"] for name in ("io_shardcache_tar", "fast_tar")
            if f"{name}_nosha256" in rates}


def ratios_of(rates: dict[str, float]) -> dict[str, float]:
    best_peer = max(rates[name] for name in PEERS)
    ratios = {
        "fast_vs_best_peer": rates["fast_tar"] / best_peer,
        "fast_hdf5_vs_best_peer": rates["fast_hdf5"] / best_peer,
        "fast_pil_vs_best_peer": rates["fast_tar_pil"] / best_peer,
        "fast_1thread_vs_best_peer": rates["fast_tar_1thread"] / best_peer,
        "fast_uint8_vs_best_peer": rates["fast_tar_uint8"] / best_peer,
        "fast_simplejpeg_vs_fast_pil": rates["fast_tar"] / rates["fast_tar_pil"],
        "fast_tar_vs_shardcache_tar": rates["fast_tar"] / rates["shardcache_tar"],
        "shardcache_tar_vs_webdataset": rates["shardcache_tar"] / rates["webdataset"],
        "shardcache_tar_vs_imagefolder": rates["shardcache_tar"] / rates["imagefolder"],
        "shardcache_hdf5_vs_imagefolder": rates["shardcache_hdf5"] / rates["imagefolder"],
        "draft_vs_shardcache_tar": rates["shardcache_tar_draft"] / rates["shardcache_tar"],
        "draft_vs_shardcache_tar_at_112": rates["shardcache_tar_112_draft"] / rates["shardcache_tar_112"],
        "io_tar_vs_imagefolder": rates["io_shardcache_tar"] / rates["io_imagefolder"],
        "io_hdf5_vs_imagefolder": rates["io_shardcache_hdf5"] / rates["io_imagefolder"],
        "io_webdataset_vs_imagefolder": rates["io_webdataset"] / rates["io_imagefolder"],
    }
    if "decode_simplejpeg_1core" in rates:
        ratios["decode_simplejpeg_vs_pil_1core"] = rates["decode_simplejpeg_1core"] / rates["decode_pil_1core"]
    return ratios


def report(rates: dict[str, float], ratios: dict[str, float], accuracy: dict, drafts: dict[str, float]) -> str:
    best = max(PEERS, key=rates.__getitem__)
    lines = [f"{'loader':<28}{'img/s':>10}"] + [f"{name:<28}{rate:>10.1f}" for name, rate in rates.items()]
    lines.append(f"best peer: {best} ({rates[best]:.1f} img/s)")
    lines += [f"{name:<40}{value:>8.2f}x" for name, value in ratios.items()]
    for decoder, numbers in accuracy.items():
        lines.append(f"fast eval vs torchvision ({decoder}, {numbers['images']} images): mean |diff| "
                     f"{numbers['mean_abs_diff_gray']:.3f} gray levels (max per image "
                     f"{numbers['max_abs_diff_gray']:.3f}), min resnet18 feature cosine "
                     f"{numbers['min_feature_cosine']:.6f}")
    lines.append(f"draft decode: mean |diff| {drafts['224']:.2f} gray levels after the 224 eval transform, "
                 f"{drafts['112']:.2f} after the 112 one")
    return "\n".join(lines)


def run(args, workdir: Path, count: int, per_shard: int) -> None:
    log.info("corpus: %d JPEGs in %s", count, workdir)
    files = build_corpus(workdir / "images", count)
    for storage in ("tar", "hdf5"):
        pack(files, workdir / storage, storage, per_shard)
    os.sync()
    tars = sorted((workdir / "tar").glob("*.tar"))
    h5s = sorted((workdir / "hdf5").glob("*.h5"))
    mean_kb = sum(p.stat().st_size for p in files) / len(files) / 1024
    log.info("mean file %.0f KB; %d tar and %d HDF5 shards; %d workers, batch %d; simplejpeg %s", mean_kb,
             len(tars), len(h5s), args.workers, args.batch_size,
             getattr(fast.simplejpeg, "__version__", "absent"))
    if args.modes:
        import loader_modes

        args.workdir = workdir
        result = loader_modes.run_modes(args, count, log)
        print(loader_modes.report(result), file=sys.stderr)
        print(json.dumps({"images": count, "workers": args.workers, "batch_size": args.batch_size,
                          "repeat": args.repeat, **result}))
        return
    if args.sha256_only:
        rates = best_of_rounds(sha256_passes(args, workdir, tars), count, args.repeat)
        costs = sha256_costs(rates)
        log.info("sha256 while streaming costs %s", ", ".join(f"{k} {v:.1%}" for k, v in costs.items()))
        print(json.dumps({"images": count, "workers": args.workers, "repeat": args.repeat,
                          "images_per_s": {k: round(v, 1) for k, v in rates.items()},
                          "sha256_cost": {k: round(v, 4) for k, v in costs.items()}}))
        return
    if args.watchdog:
        per_round = alternating_rounds(watchdog_passes(args, workdir, tars), count, args.repeat)
        rates = {name: max(values) for name, values in per_round.items()}
        cost, per_sample_us = 1 - rates["fast_tar_watchdog"] / rates["fast_tar"], watchdog_us_per_sample()
        print(f"{'round':<8}{'fast_tar':>12}{'+watchdog':>12}{'ratio':>8}", file=sys.stderr)
        for index, (plain, watched) in enumerate(zip(per_round["fast_tar"], per_round["fast_tar_watchdog"])):
            print(f"{index:<8}{plain:>12.1f}{watched:>12.1f}{watched / plain:>8.3f}", file=sys.stderr)
        median = float(np.median([w / p for p, w in zip(per_round["fast_tar"], per_round["fast_tar_watchdog"])]))
        print(f"the watchdog costs {cost:.2%} of fast-path throughput (best {rates['fast_tar_watchdog']:.1f} vs "
              f"{rates['fast_tar']:.1f} img/s; median round ratio {median:.3f}); a worker adds "
              f"{per_sample_us:.2f} us per sample", file=sys.stderr)
        print(json.dumps({"images": count, "workers": args.workers, "repeat": args.repeat,
                          "images_per_s": {k: round(v, 1) for k, v in rates.items()},
                          "images_per_s_rounds": {k: [round(v, 1) for v in vs] for k, vs in per_round.items()},
                          "watchdog_cost": round(cost, 4), "median_round_ratio": round(median, 4),
                          "watchdog_us_per_sample": round(per_sample_us, 3)}))
        return
    if args.audit:
        import loader_audit

        per_round = alternating_rounds(loader_audit.audit_passes(args, workdir, tars, fast_batches), count,
                                       args.repeat)
        rates = {name: max(values) for name, values in per_round.items()}
        costs = loader_audit.audit_costs(workdir / "tar", args, rates, rounds=max(3, 2 * args.repeat))
        print(loader_audit.report(costs), file=sys.stderr)
        print(json.dumps({"images": count, "workers": args.workers, "batch_size": args.batch_size,
                          "repeat": args.repeat, "images_per_s": {k: round(v, 1) for k, v in rates.items()},
                          **costs}))
        return
    if args.stage_times_only:
        per_round = alternating_rounds(stage_time_passes(args, workdir, tars), count, args.repeat)
        rates = {name: max(values) for name, values in per_round.items()}
        rates.update(single_core(files, min(count, 300)))
        costs, per_sample_us = stage_time_costs(rates), stage_timing_us_per_sample()
        print(stage_times_report(rates, costs, per_sample_us), file=sys.stderr)
        print(json.dumps({"images": count, "workers": args.workers, "repeat": args.repeat,
                          "images_per_s": {k: round(v, 1) for k, v in rates.items()},
                          "stage_times_cost": {k: round(v, 4) for k, v in costs.items()},
                          "stage_timing_us_per_sample": round(per_sample_us, 3)}))
        return
    passes = loader_passes(args, workdir, files, tars, h5s)
    passes.update({k: v for k, v in sha256_passes(args, workdir, tars).items() if k.endswith("_nosha256")})
    passes["fast_tar_nostagetimes"] = stage_time_passes(args, workdir, tars)["fast_tar_nostagetimes"]
    rates = best_of_rounds(passes, count, args.repeat)
    rates.update(single_core(files, min(count, 300)))
    per_sample_us = stage_timing_us_per_sample()
    accuracy = fast_accuracy(files, min(count, 50))
    drafts = {"224": draft_difference(files, min(count, 50), SPEC),
              "112": draft_difference(files, min(count, 50), SMALL_SPEC)}
    ratios = ratios_of(rates)
    print(report(rates, ratios, accuracy, drafts), file=sys.stderr)
    print(stage_times_report(rates, stage_time_costs(rates), per_sample_us), file=sys.stderr)
    print(json.dumps({"images": count, "workers": args.workers, "batch_size": args.batch_size,
                      "repeat": args.repeat, "mean_file_kb": round(mean_kb, 1),
                      "simplejpeg": getattr(fast.simplejpeg, "__version__", None),
                      "images_per_s": {k: round(v, 1) for k, v in rates.items()},
                      "best_peer": max(PEERS, key=rates.__getitem__),
                      "fast_vs_best_peer": round(ratios["fast_vs_best_peer"], 3),
                      "ratios": {k: round(v, 3) for k, v in ratios.items()},
                      "accuracy": accuracy,
                      "draft_mean_abs_diff_gray": {k: round(v, 3) for k, v in drafts.items()},
                      "sha256_cost": {k: round(v, 4) for k, v in sha256_costs(rates).items()},
                      "stage_times_cost": {k: round(v, 4) for k, v in stage_time_costs(rates).items()},
                      "stage_timing_us_per_sample": round(per_sample_us, 3)}))


if __name__ == "__main__":
    main()
