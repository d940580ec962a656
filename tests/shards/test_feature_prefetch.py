"""The in-process feature loader with a windowed order (``Sampling.feature_window``): each window's batches read a
few shards, the next window's shards load on a background thread, exact and elastic resume stay exact, and the
thread ends with the epoch however the epoch ends."""

import gc
import threading
import time

import numpy as np
import pytest
import torch

import shards
from shards.errors import CorruptDataError, InputError
from shards.loader.feature_prefetch import THREAD_NAME, WindowsAhead, joined
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset

SIZES = [7, 5, 9, 3, 6, 8, 4, 10]  # 52 rows; the first feature column is the row number


@pytest.fixture()
def folder(tmp_path):
    write_feature_dataset(tmp_path / "feat", SIZES)
    return tmp_path / "feat"


def loader(folder, *, window=6, batch=4, rank=0, world=1, seed=5, cache="memory", **options):
    dataset = shards.open_dataset(folder, "train", seed=seed, cache=cache,
                                  sampling=shards.Sampling(feature_window=window),
                                  distributed=shards.Distributed(rank=rank, world_size=world), **options)
    return shards.make_loader(dataset, batch, drop_last=False)


def rows_of(batches) -> list[int]:
    return [int(row[0]) for batch in batches for row in batch[0]]


def eventually(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


@pytest.mark.parametrize("cache", ["memory", "none"])
def test_the_loader_serves_the_windowed_order_with_its_labels_and_keys(folder, cache):
    served = loader(folder, cache=cache, return_keys=True)
    batches = list(served)
    order = served.dataset.worker_order(0, 0, 1, whole=True).served().tolist()
    assert rows_of(batches) == order
    assert [label for batch in batches for label in batch[1].tolist()] == [row % 3 for row in order]
    assert [key for batch in batches for key in batch[2]] == [f"f{row:05d}" for row in order]
    assert not prefetch_threads()


def test_a_window_reads_a_few_shards_not_all(folder):
    """The first batch of a cold epoch has loaded at most its own window's and the next window's shards."""
    served = loader(folder, window=6, batch=2)
    next(iter(served))
    offsets = np.cumsum([0] + SIZES)
    order = served.dataset.worker_order(0, 0, 1, whole=True).served()
    shard_of = np.searchsorted(offsets, order, side="right") - 1
    first_two_windows = set(shard_of[:12].tolist())
    assert set(served.dataset._shards) <= first_two_windows < set(range(len(SIZES)))


def test_the_read_ahead_gathers_one_window_ahead_and_lets_go_of_past_ones():
    gathered, release = [], threading.Event()

    def gather(start: int, stop: int) -> list:
        gathered.append((start, stop))
        if start == 6:
            release.wait(5)  # window 2 is still being gathered while window 1's batches are served
        return [torch.arange(start, stop), [f"k{i}" for i in range(start, stop)]]

    ahead = WindowsAhead(gather, positions=10, window=3)
    try:
        assert joined(ahead.pieces(0, 2))[0].tolist() == [0, 1]
        assert eventually(lambda: gathered == [(0, 3), (3, 6)])  # its own window and the next
        features, keys = joined(ahead.pieces(2, 5))  # a batch across a window's end gets both
        assert features.tolist() == [2, 3, 4] and keys == ["k2", "k3", "k4"]
        assert eventually(lambda: (6, 9) in gathered)
        assert (9, 10) not in gathered  # one window ahead, no further (the thread is held in window 2)
        release.set()
        features, keys = joined(ahead.pieces(8, 10))
        assert features.tolist() == [8, 9] and keys == ["k8", "k9"] and gathered[-1] == (9, 10)
        assert sorted(ahead._blocks) == [2, 3]  # windows 0 and 1 let go
    finally:
        release.set()
        ahead.close()
    assert not prefetch_threads()


@pytest.mark.slow  # over half a second in the quick loop
def test_the_thread_ends_when_the_iterator_is_dropped(folder):
    iterator = iter(loader(folder, window=4, batch=2))
    next(iterator)
    assert prefetch_threads()
    del iterator
    gc.collect()
    assert not prefetch_threads()


def test_the_thread_ends_when_the_training_step_raises(folder):
    def train_until_a_failure():
        for step, _ in enumerate(loader(folder, window=4, batch=2)):
            if step == 3:
                raise RuntimeError("the training step failed")

    with pytest.raises(RuntimeError, match="training step"):
        train_until_a_failure()
    assert not prefetch_threads()


def test_a_corrupt_shard_raises_in_the_training_thread_and_the_thread_ends(folder):
    served = loader(folder, window=4, batch=2, cache="none")
    order = served.dataset.worker_order(0, 0, 1, whole=True).served()
    last_shard = int(np.searchsorted(np.cumsum([0] + SIZES), order[-1], side="right") - 1)
    path = served.dataset.locations[last_shard]
    data = bytearray(open(path, "rb").read())
    data[-20] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptDataError, match=path.split("/")[-1]):
        list(served)
    assert not prefetch_threads()


@pytest.mark.parametrize("stop", [0, 3, 7, 13])
def test_exact_resume_yields_the_batches_the_epoch_had_left(folder, stop):
    whole = rows_of(loader(folder))
    interrupted = loader(folder)
    batches = iter(interrupted)
    head = rows_of(next(batches) for _ in range(stop))
    state = interrupted.state_dict()
    del batches
    resumed = loader(folder)
    resumed.load_state_dict(state)
    assert head + rows_of(resumed) == whole
    assert not prefetch_threads()


def test_elastic_resume_with_a_window_serves_each_row_left_once(folder):
    """Two ranks stop after 3 batches; three ranks continue with another batch size: every row not yet served,
    once (up to the padding of equal shares)."""
    head, state = [], None
    for rank in range(2):
        old = loader(folder, rank=rank, world=2, batch=3)
        batches = iter(old)
        head += rows_of(next(batches) for _ in range(3))
        state = old.state_dict()
    rest = []
    for rank in range(3):
        resumed = loader(folder, rank=rank, world=3, batch=2)
        resumed.load_state_dict(state)
        rest += rows_of(resumed)
    assert set(rest) == set(range(sum(SIZES))) - set(head) and len(rest) - len(set(rest)) < 3


def test_a_state_resumes_with_the_same_window_only(folder):
    interrupted = loader(folder, window=6)
    next(iter(interrupted))
    with pytest.raises(InputError, match="feature_window"):
        loader(folder, window=8).load_state_dict(interrupted.state_dict())


def test_the_window_is_seeded_and_validated(folder):
    assert rows_of(loader(folder, seed=1)) == rows_of(loader(folder, seed=1))
    assert rows_of(loader(folder, seed=1)) != rows_of(loader(folder, seed=2))
    with pytest.raises(InputError, match="feature_window"):
        shards.Sampling(feature_window=-1)


def test_image_shards_refuse_a_feature_window(tmp_path):
    make_shard_dataset(tmp_path / "img", shard_sizes={"train": [3, 2]}, size=(8, 8))
    with pytest.raises(InputError, match="feature_window"):
        shards.open_dataset(tmp_path / "img", "train", sampling=shards.Sampling(feature_window=4))
