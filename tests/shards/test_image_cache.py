"""``open_dataset(..., cache="memory")`` on image shards: decoded once, served from shared memory bit for bit, within
a limit, and never left behind in ``/dev/shm``."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import shards
from shards.errors import InputError
from shards.image import fast
from shards.cache.memory_budget import MemoryView, cgroup_memory, default_memory_limit, memory_view
from shards.cache.shared_arrays import PREFIX, SharedArrayStore
from shards.loader.loader import workers_mode
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 32
EVAL = shards.TransformSpec(preset="eval", size=32)
TRAIN = shards.TransformSpec(preset="train", size=32)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    out = tmp_path / "shards"
    make_shard_dataset(out, shard_sizes={"train": [12, 9, 11], "val": [6]}, size=(64, 48))
    return out


def open_images(folder: Path, spec=EVAL, **options):
    options.setdefault("cache", "memory")
    return shards.open_dataset(folder, "train", transform=spec, decode=shards.Decode("fast"), seed=3,
                               return_keys=True, **options)


def epoch_of(loader, epoch: int) -> tuple[list[str], torch.Tensor]:
    """One epoch's keys and images, in the order the loader yields them."""
    loader.set_epoch(epoch)
    keys, images = [], []
    for batch, _labels, batch_keys in loader:
        images.append(batch)
        keys.extend(batch_keys)
    return keys, torch.cat(images)


def loader_of(dataset, workers: int = 2):
    return shards.make_loader(dataset, batch_size=4, mode=workers_mode(workers), drop_last=False)


def pixel_files(pid: int | None = None) -> list[str]:
    """This test's cache files in the folders a store may use: there should never be any (unlinked at once)."""
    prefix = PREFIX if pid is None else f"{PREFIX}{pid}-"
    folders = {d for d in ("/dev/shm", os.environ.get("TMPDIR", "/tmp")) if os.path.isdir(d)}
    return [name for d in folders for name in os.listdir(d) if name.startswith(prefix)]


def test_eval_cache_serves_exactly_the_uncached_crops(folder: Path):
    plain = loader_of(open_images(folder, cache="none"))
    cached_set = open_images(folder)
    cached = loader_of(cached_set)
    expected = epoch_of(plain, 0)
    cold, warm, later = epoch_of(cached, 0), epoch_of(cached, 0), epoch_of(cached, 1)
    assert cold[0] == warm[0] == expected[0]
    assert torch.equal(cold[1], expected[1]) and torch.equal(warm[1], expected[1])
    assert torch.equal(later[1], epoch_of(plain, 1)[1])
    stats = cached_set.image_cache.stats()
    assert stats["cached"] == SAMPLES and stats["misses"] == SAMPLES and stats["hits"] == 2 * SAMPLES


def test_train_epoch_from_a_warm_cache_equals_it_from_a_cold_one(folder: Path):
    warmed = loader_of(open_images(folder, TRAIN))
    first = epoch_of(warmed, 0)  # decodes every sample, keeping the bounded images
    warm = epoch_of(warmed, 1)
    cold = epoch_of(loader_of(open_images(folder, TRAIN)), 1)  # a fresh cache: epoch 1 decodes
    assert warm[0] == cold[0]
    assert warm[1].dtype == torch.uint8 and warm[1].shape == (SAMPLES, 3, 32, 32)
    assert torch.equal(warm[1], cold[1])
    assert not torch.equal(first[1], warm[1])  # augmentations still change from epoch to epoch


def test_train_views_are_cropped_from_the_bounded_image_in_every_epoch(folder: Path):
    """The first (cold) epoch crops from the image bounded to ``cache_side`` too: the same source every epoch."""
    dataset = open_images(folder, TRAIN, cache=shards.MemoryCache(side=40))
    assert dataset.decoder.geometry.source_side == 40
    uncached = open_images(folder, TRAIN, cache="none")
    uncached.decoder = fast.FastDecoder(TRAIN, source_side=40)
    assert torch.equal(epoch_of(loader_of(dataset), 2)[1], epoch_of(loader_of(uncached), 2)[1])
    shapes = {tuple(dataset.image_cache.store.get(i).shape) for i in range(SAMPLES)}
    assert shapes == {(40, 53, 3)}  # 64x48 bounded to 40 on the shorter side, stored as decoded (HWC)


def test_later_epochs_do_not_decode(folder: Path, monkeypatch):
    calls = multiprocessing.Value("i", 0)
    decode = fast.decode_rgb_array

    def counted(data, min_size=None):
        with calls.get_lock():
            calls.value += 1
        return decode(data, min_size)

    monkeypatch.setattr(fast, "decode_rgb_array", counted)  # forked workers inherit the patch
    loader = loader_of(open_images(folder, TRAIN))
    epoch_of(loader, 0)
    first = loader.stage_seconds()
    assert calls.value == SAMPLES and first["decode"] > 0
    epoch_of(loader, 1)
    epoch_of(loader, 2)
    second = loader.stage_seconds()
    assert calls.value == SAMPLES
    assert second["decode"] - first["decode"] < 0.25 * first["decode"]  # a few clock reads, no decoding
    assert second["transform"] > first["transform"]  # the crops from the cache count as transform


def test_over_the_limit_part_is_cached_and_the_rest_decoded(folder: Path):
    crop = 3 * 32 * 32  # a multiple of the store's alignment: exactly 10 crops fit
    dataset = open_images(folder, cache=shards.MemoryCache(limit=10 * crop))
    loader = loader_of(dataset)
    expected = epoch_of(loader_of(open_images(folder, cache="none")), 0)[1]
    assert torch.equal(epoch_of(loader, 0)[1], expected)
    assert torch.equal(epoch_of(loader, 0)[1], expected)
    stats = dataset.image_cache.stats()
    assert stats["cached"] == 10 and stats["full"] == 1 and stats["bytes"] == 10 * crop
    assert stats["hits"] == 10 and stats["misses"] == SAMPLES + SAMPLES - 10


def test_over_the_limit_says_so_once(folder: Path, caplog):
    dataset = open_images(folder, cache=shards.MemoryCache(limit="12K"))
    with caplog.at_level(logging.WARNING, logger="shards.cache.images"):
        for epoch in range(3):
            dataset.set_epoch(epoch)
            assert len(list(dataset)) == SAMPLES
    lines = [r.getMessage() for r in caplog.records if "image cache full" in r.getMessage()]
    assert len(lines) == 1 and "4 of 32 samples cached" in lines[0], lines


def held_cache_files() -> set[str]:
    """The cache files this process holds open, as ``/proc/self/fd`` names them."""
    links = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return {link for link in links if PREFIX in link}


def test_the_cache_file_is_unlinked_while_in_use_and_nothing_is_left(folder: Path):
    before, files_before = held_cache_files(), set(pixel_files())
    dataset = open_images(folder)
    epoch_of(loader_of(dataset), 0)
    held = held_cache_files() - before
    assert len(held) == 1 and held.pop().endswith("(deleted)")  # the memory is held by descriptors only
    assert set(pixel_files()) == files_before
    dataset.close()
    assert held_cache_files() - before == set()


KILLED_RUN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    import shards
    from shards.loader.worker_processes import WorkerProcesses
    dataset = shards.open_dataset(sys.argv[1], "train", transform=shards.TransformSpec(preset="eval", size=32),
                                  decode=shards.Decode("fast"), cache="memory")
    loader = shards.make_loader(dataset, batch_size=4, mode=WorkerProcesses(2))
    for batch in loader:
        print("ready", flush=True)
        time.sleep(60)
""")


def mapped_by(prefix: str) -> list[int]:
    """Processes that still map a file whose name starts with ``prefix``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if prefix in Path(f"/proc/{pid}/maps").read_text():
                found.append(int(pid))
        except OSError:
            continue
    return found


class KilledRun:
    """A run whose main process (a loader with two persistent workers, mid-epoch) is SIGKILLed."""

    def __init__(self, folder: Path, tmp_path: Path):
        script = tmp_path / "killed_run.py"
        script.write_text(KILLED_RUN)
        self.process = subprocess.Popen([sys.executable, str(script), str(folder), str(ROOT)],
                                        stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.prefix = f"{PREFIX}{self.process.pid}-"

    def kill_main_process(self) -> None:
        assert self.process.stdout.readline().strip() == "ready"
        assert len(mapped_by(self.prefix)) == 3  # the main process and its two workers share one mapping
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the orphaned workers too
        self.process.stdout.close()


@pytest.mark.slow
def test_no_file_is_left_after_sigkill(folder: Path, tmp_path: Path):
    run = KilledRun(folder, tmp_path)
    try:
        run.kill_main_process()
        assert pixel_files(run.process.pid) == []
    finally:
        run.close()


@pytest.mark.slow
def test_memory_is_released_after_sigkill(folder: Path, tmp_path: Path):
    run = KilledRun(folder, tmp_path)
    try:
        run.kill_main_process()
        # Orphaned workers notice within a second (shards.loader.worker_processes.OrphanGuard), also one still
        # starting up, which torch's own watchdog would miss forever.
        deadline = time.monotonic() + 20
        while mapped_by(run.prefix) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mapped_by(run.prefix) == []  # no process holds the file: the kernel has freed it
    finally:
        run.close()


def _store_in_child(store: SharedArrayStore, results) -> None:
    results.put(store.get(0).tolist())
    store.put(1, np.full((1, 2, 3), 9, np.uint8))


@pytest.mark.slow
def test_spawned_processes_share_the_store():
    """A spawned (not forked) worker gets the descriptor while it starts and maps the same memory."""
    store = SharedArrayStore(samples=2, capacity=1 << 12)
    store.put(0, np.arange(6, dtype=np.uint8).reshape(1, 2, 3))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_store_in_child, args=(store, results))
    child.start()
    assert results.get(timeout=60) == [[[0, 1, 2], [3, 4, 5]]]
    child.join(60)
    assert child.exitcode == 0
    assert store.get(1).tolist() == [[[9, 9, 9], [9, 9, 9]]]
    store.close()


def test_a_copy_outside_a_process_start_caches_nothing_and_yields_the_same(folder: Path):
    import pickle

    dataset = open_images(folder)
    copy = pickle.loads(pickle.dumps(dataset))
    assert not copy.image_cache.store.attached
    assert torch.equal(torch.stack([s for s, _, _ in copy]), torch.stack([s for s, _, _ in dataset]))


def test_options_are_checked(folder: Path, tmp_path: Path):
    with pytest.raises(InputError, match="needs decode=Decode\\('fast'\\)"):
        shards.open_dataset(folder, "train", transform="eval", cache="memory")
    with pytest.raises(InputError, match="eval preset caches its final crops"):
        open_images(folder, cache=shards.MemoryCache(side=64))
    with pytest.raises(InputError, match="smaller than the crop size"):
        open_images(folder, TRAIN, cache=shards.MemoryCache(side=16))
    with pytest.raises(InputError, match="memory_limit"):
        open_images(folder, cache=shards.MemoryCache(limit="lots"))
    with pytest.raises(InputError, match="one of auto, memory, none"):
        open_images(folder, cache="disk")
    write_feature_dataset(tmp_path / "features", [5])
    with pytest.raises(InputError, match="MemoryCache apply to image shards"):
        shards.open_dataset(tmp_path / "features", "train", cache=shards.MemoryCache(limit="1G"))


# -- the default limit: what the job's cgroup (or the machine) has left ---------------------------------------
def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_is_the_tightest_on_the_way_up(tmp_path: Path):
    root = tmp_path / "cgroup"
    job = root / "system.slice" / "slurmstepd.scope" / "job_42"
    write(job / "memory.max", str(8 << 30))
    write(job / "memory.current", str(3 << 30))
    write(job / "memory.stat", f"anon {2 << 30}\ninactive_file {1 << 30}\nactive_file 0\n")
    write(job / "step_0" / "memory.max", "max")
    write(job / "step_0" / "memory.current", str(1 << 30))
    write(tmp_path / "proc_cgroup", "0::/system.slice/slurmstepd.scope/job_42/step_0\n")
    view = cgroup_memory(root, tmp_path / "proc_cgroup")
    assert view.limit == 8 << 30 and view.used == 2 << 30  # inactive page cache is not use
    assert default_memory_limit(view=view) == 3 << 30
    assert default_memory_limit(view=view, reserved=2 << 30) == 2 << 30


def test_cgroup_v1_limit_and_no_limit(tmp_path: Path):
    root = tmp_path / "cgroup"
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712")  # v1's "no limit"
    write(root / "memory" / "slurm" / "job_7" / "memory.limit_in_bytes", str(4 << 30))
    write(root / "memory" / "slurm" / "job_7" / "memory.usage_in_bytes", str(1 << 30))
    write(tmp_path / "proc_cgroup", "9:name=systemd:/\n4:memory:/slurm/job_7\n0::/\n")
    view = cgroup_memory(root, tmp_path / "proc_cgroup")
    assert (view.limit, view.used) == (4 << 30, 1 << 30) and "v1" in view.source
    write(tmp_path / "unlimited", "4:memory:/\n")
    assert cgroup_memory(root, tmp_path / "unlimited") is None


def test_without_a_cgroup_limit_the_machine_counts(tmp_path: Path):
    write(tmp_path / "meminfo", "MemTotal:       16777216 kB\nMemFree: 1 kB\nMemAvailable:    8388608 kB\n")
    write(tmp_path / "proc_cgroup", "0::/\n")
    view = memory_view(tmp_path / "none", tmp_path / "proc_cgroup", tmp_path / "meminfo")
    assert (view.limit, view.used) == (16 << 30, 8 << 30)
    assert default_memory_limit(view=MemoryView(16 << 30, 8 << 30, "test")) == 4 << 30
