"""Resume at ImageNet size: the order's positions are numpy index arithmetic that matches the shuffle buffer's
definition exactly, a resumed worker reads only the rows still to come, an elastic replay of 1.28M rows takes well
under a second, and the saved position does not grow with the data.
"""

import json
import random
import time

import numpy as np
import pytest

import shards
from shards.position.elastic import SavedState, remaining_after
from shards.order.order import FULL, EpochSource, WorkerOrder, buffer_positions
from shards.order.plan import epoch_sizes, rng_for
from shards.position.resume import LoaderState, worker_consumed
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset


def reference_shuffle_buffer(n: int, size: int, rng: np.random.Generator) -> list[int]:
    """The shuffle buffer's rule as first written, item by item: the definition ``buffer_positions`` must match."""
    if size <= 1:
        return list(range(n))
    buffer: list[int] = []
    draws = iter(())
    out = []
    for item in range(n):
        if len(buffer) < size:
            buffer.append(item)
            continue
        try:
            u = next(draws)
        except StopIteration:
            draws = iter(rng.random(1024).tolist())
            u = next(draws)
        index = int(u * len(buffer))
        buffer[index], item = item, buffer[index]
        out.append(item)
    return out + [buffer[i] for i in rng.permutation(len(buffer))]


EDGE_CASES = [(0, 4), (1, 4), (3, 4), (4, 4), (5, 4), (4 + 1024, 4), (5 + 1024, 4), (2, 2), (70_000, 3),
              (3 + 64 * 1024, 3), (4 + 64 * 1024, 3), (20_000, 512), (1_000, 70_000)]
RANDOM_CASES = [(random.Random(i).randrange(0, 5_000), random.Random(-i).choice([2, 3, 7, 50, 512, 3_000]))
                for i in range(30)]


@pytest.mark.parametrize("n,size", EDGE_CASES + RANDOM_CASES)
def test_buffer_positions_are_the_shuffle_buffers_order(n, size):
    seed = n * 7919 + size
    got = np.concatenate([np.zeros(0, dtype=np.int64), *buffer_positions(n, size, rng_for(seed, 2))])
    assert got.tolist() == reference_shuffle_buffer(n, size, rng_for(seed, 2))


def orders(n: int) -> list[WorkerOrder]:
    rows = np.arange(n, dtype=np.int64) * 3 + 11
    return [WorkerOrder(rows, 0, (1, 2)), WorkerOrder(rows, 1, (1, 2)), WorkerOrder(rows, 6, (1, 2)),
            WorkerOrder(rows, 5_000, (4, 2)), WorkerOrder(rows, FULL, (1, 2)),
            WorkerOrder(rows, FULL, (1, 2), window=7)]


@pytest.mark.parametrize("n", [0, 1, 5, 40, 3_000])
def test_first_yields_and_arranged_items_follow_the_served_order(n):
    for order in orders(n):
        served = order.served()
        assert sorted(served.tolist()) == order.rows.tolist()
        assert list(order.arrange(iter(order.rows.tolist()))) == served.tolist()
        for count in (0, 1, n // 3, n, n + 4):
            assert order.yielded(count).tolist() == served[:count].tolist()


@pytest.mark.parametrize("n", [1, 5, 40, 3_000])
def test_after_a_skip_the_order_is_the_rest_read_in_order(n):
    for order in orders(n):
        served = order.served()
        for skip in (0, 1, n // 2, n - 1, n):
            rest = order.after(skip)
            assert rest.served().tolist() == served[skip:].tolist()
            assert list(rest.arrange(iter(rest.rows.tolist()))) == served[skip:].tolist()
            assert sorted(rest.rows.tolist()) == rest.rows.tolist()  # these rows grow with the read order
            assert len(rest.rows) == n - skip


@pytest.fixture()
def images(tmp_path):
    make_shard_dataset(tmp_path, shard_sizes={"train": [7, 5, 9, 3, 6, 8]}, size=(8, 8))
    return tmp_path


def test_a_resumed_worker_never_reads_the_shards_it_had_finished(images):
    """Shards whose every row was yielded before the save are overwritten with zeros: a resume that read them to
    drop their samples would raise; it yields exactly what the uninterrupted epoch had left."""

    def dataset():
        return shards.open_dataset(images, return_keys=True, seed=5, sampling=shards.Sampling(shuffle_buffer=4),
                                   errors=shards.ErrorPolicy(on_error="raise"))

    full = [key for _, _, key in dataset()]
    taken = 26
    interrupted = dataset()
    iterator = iter(interrupted)
    for _ in range(taken):
        next(iterator)
    state = interrupted.state_dict()
    yielded = set(interrupted.worker_order(0, 0, 1).yielded(taken).tolist())
    sizes = interrupted.split_info.shard_sizes
    starts = np.concatenate([[0], np.cumsum(sizes)])
    finished = [s for s in range(len(sizes)) if set(range(starts[s], starts[s + 1])) <= yielded]
    assert finished, "the case must finish a shard before the save"
    for shard in finished:
        path = images / interrupted.split_info.shards[shard].path
        path.write_bytes(bytes(path.stat().st_size))
    resumed = dataset()
    resumed.load_state_dict(state)
    assert [key for _, _, key in resumed] == full[taken:]


def test_elastic_replay_of_an_imagenet_sized_epoch_is_fast_and_exact_in_count():
    """1,280 shards x 1,000 rows, saved at 90% of an epoch by 2 ranks x 4 workers with a shuffle buffer: the rows
    left are distinct rows of the epoch, as many as the workers had not yielded, found in well under a second."""
    source = EpochSource((1_000,) * 1_280, 0, True, 512, False, False)
    per_rank = epoch_sizes(1_280_000, 2, False).per_rank
    batches = -(-per_rank // 256) * 9 // 10  # 90% of each rank's batches
    state = LoaderState("stream", 0, batches, batch_size=256, num_workers=4, drop_last=False, seed=0, world_size=2,
                        split_batch=256)
    consumed = 2 * sum(worker_consumed(per_rank, state)[0])
    best = float("inf")
    for _ in range(2):
        began = time.perf_counter()
        left = remaining_after(source, SavedState.of(state))
        best = min(best, time.perf_counter() - began)
    assert len(left) == 1_280_000 - consumed
    assert len(np.unique(left)) == len(left) and left.min() >= 0 and left.max() < 1_280_000
    assert best < 1.0, f"replay took {best:.2f} s"


@pytest.mark.parametrize("shard_sizes", [[5, 4, 6], [100] * 40])
def test_the_saved_position_does_not_grow_with_the_data(tmp_path, shard_sizes):
    """Every field of a state is a number, a short string or a dict of settings, and with the state an elastic
    resume carries (``prior``) it stays under 1 KB, for 15 rows as for 4,000."""
    write_feature_dataset(tmp_path, shard_sizes)
    dataset = shards.open_dataset(tmp_path, seed=1)
    saving = shards.make_loader(dataset, 4, drop_last=False)
    iterator = iter(saving)
    next(iterator)
    state = saving.state_dict()
    resumed = shards.make_loader(shards.open_dataset(tmp_path, seed=1), 3, drop_last=False)  # another batch size
    resumed.load_state_dict(state)
    continued = resumed.state_dict()
    audits = [state.pop("audit"), continued.pop("audit")]  # beside the position: bounded by the batch size
    assert continued["prior"] == state
    assert all(len(json.dumps(audit)) < 1024 for audit in audits)
    for saved in (state, continued):
        assert len(json.dumps(saved)) < 1024
        assert all(isinstance(v, (int, str, bool, type(None))) or k in ("sampling", "prior")
                   for k, v in saved.items())
        assert not any(isinstance(v, list) for v in saved["sampling"].values() if v is not None)
