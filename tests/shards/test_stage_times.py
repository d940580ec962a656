"""Worker-side stage seconds: read, decode, transform and collate, summed over a rank's workers, at no cost to
what the loader yields."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data._utils.collate import default_collate

import shards
from shards.image.decode import ImageDecoder
from shards.image.fast import FastDecoder
from shards.image.transforms import TransformSpec, build_transform
from shards.formats.sample import RawSample
from shards.loader.in_process import InProcess
from shards.procs.decode_mark import decode_mark
from shards.procs.stage_times import WORKER_STAGES, SharedStageTimes, StageTally
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import class_image, make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset

DECODE_S = 0.005
TRANSFORM_S = 0.001
SAMPLES = 48  # train split below: shards of 20, 14 and 14


class SleepyDecoder:
    """Takes DECODE_S to "decode" and TRANSFORM_S to "transform", marking the boundary as the built-in decoders do."""

    decoded_at = None

    def __call__(self, sample, seed):
        time.sleep(DECODE_S)
        self.decoded_at = time.perf_counter()
        time.sleep(TRANSFORM_S)
        return torch.full((3, 4, 4), sample.label, dtype=torch.uint8)


def sleepy_user_decoder(sample, seed):
    """A user's decoder with no ``decoded_at``."""
    time.sleep(DECODE_S + TRANSFORM_S)
    return torch.zeros(3, 4, 4)


class SlowCollate:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, batch):
        time.sleep(self.seconds)
        return default_collate(batch)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stage_times") / "images"
    make_shard_dataset(out, classes=("red", "green", "blue"), shard_sizes={"train": [20, 14, 14]}, size=(64, 48))
    return out


def drain(loader) -> int:
    return sum(len(batch[1]) for batch in loader)


def test_decode_and_transform_are_split_at_the_decoders_mark_and_summed_over_workers(folder: Path):
    dataset = shards.open_dataset(folder, "train", decode=shards.Decode(decoder=SleepyDecoder()), seed=0)
    loader = shards.make_loader(dataset, batch_size=8, mode=WorkerProcesses(2, persistent=False))
    assert drain(loader) == SAMPLES
    seconds = loader.stage_seconds()
    assert set(seconds) == set(WORKER_STAGES)
    assert all(seconds[name] > 0 for name in WORKER_STAGES), seconds
    # Each of the two workers decodes half the samples: only the sum over both reaches SAMPLES x DECODE_S. Both
    # bounds are floors (a sleep never ends early), so a loaded machine cannot fail them; a split ignoring the mark
    # leaves transform at 0, and per-worker (not summed) seconds fall short of the floors.
    assert seconds["decode"] >= SAMPLES * DECODE_S
    assert seconds["transform"] >= SAMPLES * TRANSFORM_S


def test_a_decoder_without_the_mark_counts_all_as_decode(folder: Path):
    dataset = shards.open_dataset(folder, "train", decode=shards.Decode(decoder=sleepy_user_decoder), seed=0)
    loader = shards.make_loader(dataset, batch_size=8, mode=WorkerProcesses(2, persistent=False))
    assert drain(loader) == SAMPLES
    seconds = loader.stage_seconds()
    assert seconds["transform"] == 0.0
    assert seconds["decode"] >= SAMPLES * (DECODE_S + TRANSFORM_S)


def test_collate_seconds_are_counted(folder: Path):
    dataset = shards.open_dataset(folder, "train", decode=shards.Decode(decoder=SleepyDecoder()), seed=0)
    loader = shards.make_loader(dataset, batch_size=8, mode=WorkerProcesses(2, persistent=False),
                                collate_fn=SlowCollate(0.02))
    assert drain(loader) == SAMPLES
    assert loader.stage_seconds()["collate"] >= 6 * 0.02  # 6 batches of 8, a floor only


@pytest.mark.parametrize("pipeline", ["standard", "fast"])
@pytest.mark.slow
def test_outputs_are_bit_identical_with_and_without_stage_times(folder: Path, pipeline: str):
    spec = TransformSpec(preset="train", size=32)
    runs = {}
    for stage_times in (True, False):
        dataset = shards.open_dataset(folder, "train", transform=spec, decode=shards.Decode(pipeline), seed=3)
        loader = shards.make_loader(dataset, batch_size=8, mode=WorkerProcesses(2, persistent=False),
                                    stage_times=stage_times)
        runs[stage_times] = list(loader)
        seconds = loader.stage_seconds()
        if stage_times:
            assert all(seconds[name] > 0 for name in WORKER_STAGES), seconds
        else:
            assert seconds == dict.fromkeys(WORKER_STAGES, 0.0)
    assert len(runs[True]) == len(runs[False]) == 6
    for (images, labels), (plain_images, plain_labels) in zip(runs[True], runs[False]):
        assert torch.equal(images, plain_images) and torch.equal(labels, plain_labels)


def test_built_in_decoders_mark_the_end_of_decoding_inside_the_call():
    sample = RawSample("k", class_image(0, 0, (64, 48)), "jpg", 0, b"")
    spec = TransformSpec(preset="train", size=32)
    for decoder in (ImageDecoder(), ImageDecoder(build_transform(spec)), FastDecoder(spec),
                    FastDecoder(TransformSpec(preset="eval", size=32))):
        began = time.perf_counter()
        decoder(sample, 5)
        assert began <= decode_mark() <= time.perf_counter()


def test_a_decode_mark_is_the_calling_threads_own():
    """Threads sharing one decoder (the thread run mode) split each call at their own mark, never another's."""
    sample = RawSample("k", class_image(0, 0, (64, 48)), "jpg", 0, b"")
    decoder = FastDecoder(TransformSpec(preset="eval", size=32))
    decoder(sample, 0)
    here = decode_mark()
    marks = []

    def other() -> None:
        marks.append(decode_mark())  # a new thread has none yet
        decoder(sample, 0)
        marks.append(decode_mark())

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert marks[0] is None and marks[1] > here
    assert decode_mark() == here  # the other thread's call left this thread's mark alone


@pytest.mark.slow  # two epochs of persistent worker processes
def test_per_epoch_differences_with_persistent_workers_and_a_reset(folder: Path):
    dataset = shards.open_dataset(folder, "train", decode=shards.Decode(decoder=SleepyDecoder()), seed=0)
    loader = shards.make_loader(dataset, batch_size=8, mode=WorkerProcesses(2))
    drain(loader)
    first = loader.stage_seconds()
    drain(loader)
    second = loader.stage_seconds()
    epoch_two = second["decode"] - first["decode"]
    assert epoch_two >= SAMPLES * DECODE_S  # every worker flushed its seconds before the epoch ended
    loader.reset_stage_seconds()
    assert loader.stage_seconds() == dict.fromkeys(WORKER_STAGES, 0.0)


def test_in_process_iteration_counts_too(folder: Path):
    dataset = shards.open_dataset(folder, "train", decode=shards.Decode(decoder=SleepyDecoder()), seed=0)
    assert sum(1 for _ in dataset) == SAMPLES
    seconds = dataset.stage_seconds()
    assert seconds["read"] > 0 and seconds["decode"] >= SAMPLES * DECODE_S and seconds["collate"] == 0.0


def test_feature_loaders_report_read_only(tmp_path: Path):
    write_feature_dataset(tmp_path / "features", [30, 20])
    in_process = shards.make_loader(shards.open_dataset(tmp_path / "features", "train", seed=0), batch_size=8)
    assert in_process.mode == InProcess()
    assert drain(in_process) == 48  # drop_last: 50 rows in batches of 8
    seconds = in_process.stage_seconds()
    assert seconds["read"] > 0 and seconds["decode"] == seconds["transform"] == seconds["collate"] == 0.0
    in_process.reset_stage_seconds()
    assert in_process.stage_seconds()["read"] == 0.0

    with_workers = shards.make_loader(shards.open_dataset(tmp_path / "features", "train", seed=0), batch_size=8,
                                      mode=WorkerProcesses(2, persistent=False))
    assert drain(with_workers) == 48
    seconds = with_workers.stage_seconds()
    assert seconds["read"] > 0 and seconds["collate"] > 0
    assert seconds["decode"] == seconds["transform"] == 0.0


@pytest.mark.slow
def test_shared_block_reaches_a_spawned_process_and_a_copy_keeps_values():
    shared = SharedStageTimes()
    shared.add(0, [1.0, 2.0, 0.0, 0.5])
    spawn = multiprocessing.get_context("spawn")
    child = spawn.Process(target=shared.add_one, args=(1, 1, 3.0))  # another worker's row
    child.start()
    child.join(60)
    assert shared.snapshot() == {"read": 1.0, "decode": 5.0, "transform": 0.0, "collate": 0.5}
    copy = pickle.loads(pickle.dumps(shared))
    copy.add_one(0, 0, 1.0)
    assert copy.snapshot()["read"] == 2.0 and shared.snapshot()["read"] == 1.0


def test_tally_writes_once_per_batch():
    shared = SharedStageTimes()
    tally = StageTally(shared, flush_every=3, slot=0)
    for _ in range(2):
        tally.decoded(0.0, 0.25, 1.0)
    assert shared.snapshot()["decode"] == 0.0  # still pending: two samples of a batch of three
    tally.decoded(0.0, None, 1.0)  # no mark: all decode
    assert shared.snapshot() == {"read": 0.0, "decode": 1.5, "transform": 1.5, "collate": 0.0}
    tally.decoded(0.0, 7.0, 1.0)  # a stale or foreign mark outside the call: all decode
    tally.flush()
    assert shared.snapshot()["decode"] == 2.5
