"""The one order function (``shards.order.order.worker_order``) against what iteration really yields and what
elastic replay says was yielded, over random layouts, sizes, seeds, shuffles, mixtures, subsets and class weights.

Iteration reads shards (covering reads, a subset's scattered rows, a mixture's repeated passes) and puts what it
read in yield order; replay never reads. Feature shards carry their row number in their first column, so what a
worker yielded is known exactly; an image case checks the same through keys.
"""

import collections
import random
from dataclasses import replace

import numpy as np
import pytest

import shards
import shards.errors as shards_errors
from shards.order.order import EpochSource
from shards.position.elastic import SavedState, remaining_after
from shards.position.resume import LoaderState
from shards.loader.in_process import InProcess
from shards.loader.threads import Threads
from shards.loader.worker_processes import WorkerProcesses
from shards.loader.loader import workers_mode
from shards.stream.worker_stream import StreamJob
from tests.helpers import make_shard_dataset
from tests.shards.label_columns import add_label_columns
from tests.shards.stream_helpers import write_feature_dataset

SOURCE_B_ROW = 1000  # source B's first-column values start here (float16 is exact to 2048)
CASES = 40


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("order")
    rng = random.Random(5)
    write_feature_dataset(root / "a", [rng.randint(1, 9) for _ in range(7)])
    write_feature_dataset(root / "b", [rng.randint(1, 6) for _ in range(4)], first_row=SOURCE_B_ROW)
    make_shard_dataset(root / "img", shard_sizes={"train": [7, 5, 9, 3, 6]}, size=(8, 8))
    add_label_columns(root / "img")  # the labels class weighting draws by
    return root


def layout(case: int) -> dict:
    rng = random.Random(case)
    return dict(world=rng.choice([1, 2, 3]), workers=rng.choice([1, 2, 3]), batch=rng.choice([1, 2, 3, 5]),
                buffer=rng.choice([0, 1, 4, 50]), shuffle=rng.random() < 0.8, seed=rng.randrange(1000),
                epoch=rng.randrange(5), balance=rng.choice(["pad", "drop"]),
                source=rng.choice(["plain", "subset", "mixture", "mixture_subset"]),
                window=rng.choice([0, 0, 1, 3, 8, 100]),
                weights=rng.choice([None, None, "balanced", (1.0, 0.0, 3.0), (5.0, 1.0, 1.0)]))


def open_features(folders, case: dict, rank: int):
    subset = {"subset": shards.Subset(classes=["a", "c"])} if case["source"].endswith("subset") else {}
    path = shards.SourceSpec(str(folders / "a"), **subset) if subset else folders / "a"
    if case["source"].startswith("mixture"):
        path = [shards.SourceSpec(str(folders / "a"), weight=2, **subset),
                shards.SourceSpec(str(folders / "b"), weight=1, **subset)]
    return shards.open_dataset(path, "train", seed=case["seed"],
                               sampling=shards.Sampling(shuffle=case["shuffle"], shuffle_buffer=case["buffer"],
                                                        balance=case["balance"], feature_window=case["window"],
                                                        class_weights=case.get("weights")),
                               distributed=shards.Distributed(rank=rank, world_size=case["world"]))


def combined_row(dataset, value: float) -> int:
    """A feature row's first column -> its row in the dataset's (possibly combined) split."""
    value = int(value)
    if value >= SOURCE_B_ROW:
        return sum(dataset.split_info.shard_sizes[:7]) + value - SOURCE_B_ROW
    return value


def yielded_rows(dataset, epoch: int, worker: int, workers: int, batch: int) -> list[int]:
    return [combined_row(dataset, features[0]) for features, _ in
            dataset.worker_stream(StreamJob(epoch, worker, workers, split_batch=batch))]


@pytest.mark.parametrize("index", range(CASES))
@pytest.mark.slow
def test_each_worker_yields_exactly_the_order_functions_rows(folders, index):
    case = layout(index)
    for rank in range(case["world"]):
        dataset = open_features(folders, case, rank)
        for worker in range(case["workers"]):
            order = dataset.worker_order(case["epoch"], worker, case["workers"], split_batch=case["batch"])
            assert yielded_rows(dataset, case["epoch"], worker, case["workers"], case["batch"]) == \
                order.served().tolist(), case


def dataloader_consumed(streams: list[list[int]], batch: int, drop_last: bool, batches: int) -> list[int]:
    """A DataLoader's in-order round robin over workers' streams, modelled step by step: the rows of the first
    ``batches`` batches."""
    chunks = [[s[i:i + batch] for i in range(0, len(s), batch)] for s in streams]
    chunks = [[c for c in worker if len(c) == batch or not drop_last] for worker in chunks]
    taken, pointer, out = [0] * len(chunks), 0, []
    while batches > 0 and any(t < len(c) for t, c in zip(taken, chunks)):
        if taken[pointer] < len(chunks[pointer]):
            out += chunks[pointer][taken[pointer]]
            taken[pointer] += 1
            batches -= 1
        pointer = (pointer + 1) % len(chunks)
    return out


@pytest.mark.parametrize("index", range(CASES))
@pytest.mark.slow
def test_replay_finds_what_iteration_left(folders, index):
    """Stop every rank after the same random number of batches: the rows replay says are left are the epoch's rows
    that no rank's workers had yielded, as a multiset."""
    case = layout(index)
    rng = random.Random(1000 + index)
    drop_last = rng.random() < 0.5
    consumed, state = collections.Counter(), None
    for rank in range(case["world"]):
        dataset = open_features(folders, case, rank)
        dataset.set_epoch(case["epoch"])
        streams = [yielded_rows(dataset, case["epoch"], w, case["workers"], case["batch"])
                   for w in range(case["workers"])]
        loader = shards.make_loader(dataset, case["batch"], mode=workers_mode(case["workers"], persistent=False),
                                    drop_last=drop_last)
        if rank == 0:
            stop = rng.randint(0, len(loader))
            state = LoaderState.from_dict(loader.cursor.position(stop).to_dict())
            source = dataset.epoch_source()
            epoch_rows = source.epoch_stream(case["epoch"], case["world"], 1)
        consumed.update(dataloader_consumed(streams, case["batch"], drop_last, stop))
    left = remaining_after(source, SavedState.of(state))
    expected = collections.Counter(epoch_rows.tolist())
    expected.subtract(consumed)
    assert collections.Counter(left.tolist()) == +expected, case


MODES = {"processes": lambda n: WorkerProcesses(n, persistent=False), "threads": Threads,
         "threads_decoders": lambda n: Threads(n, decoders=2),
         "processes_threads": lambda n: WorkerProcesses(n, persistent=False, decoders=2)}


# Every layout in threads; every other one in processes, which start a worker process per worker (over half a
# second each: the full suite runs them; the threads modes run the same batch dealing in every layout).
MODE_CASES = [(index, mode) if not mode.startswith("processes")
              else pytest.param(index, mode, marks=pytest.mark.slow)
              for index in range(0, CASES, 3) for mode in MODES if not (mode.startswith("processes") and index % 2)]


@pytest.mark.parametrize("index,mode", MODE_CASES)
def test_every_run_mode_feeds_the_order_functions_batches(folders, index, mode):
    """Whatever makes the batches (worker processes, threads, threads decoding for them, threads inside processes),
    a rank's epoch is the workers' order-function rows, dealt in the DataLoader's round robin of whole batches."""
    case = layout(index)
    drop_last = random.Random(2000 + index).random() < 0.5
    for rank in range(case["world"]):
        dataset = open_features(folders, case, rank)
        dataset.set_epoch(case["epoch"])
        streams = [dataset.worker_order(case["epoch"], w, case["workers"], split_batch=case["batch"]).served().tolist()
                   for w in range(case["workers"])]
        loader = shards.make_loader(dataset, case["batch"], mode=MODES[mode](case["workers"]), drop_last=drop_last)
        fed = [[combined_row(dataset, row[0]) for row in features] for features, _ in loader]
        assert len(fed) == len(loader), case
        assert [row for batch in fed for row in batch] == \
            dataloader_consumed(streams, case["batch"], drop_last, len(fed)), case


@pytest.mark.parametrize("index", range(0, CASES, 2))
def test_the_in_process_feature_loader_serves_its_order(folders, index):
    case = layout(index)
    for rank in range(case["world"]):
        dataset = open_features(folders, case, rank)
        dataset.set_epoch(case["epoch"])
        loader = shards.make_loader(dataset, case["batch"], drop_last=False)
        served = [combined_row(dataset, row[0]) for features, _ in loader for row in features]
        order = dataset.worker_order(case["epoch"], 0, 1, whole=True)
        assert served == order.served().tolist()
        assert len(served) == len(dataset)


@pytest.mark.parametrize("weights", [None, (1.0, 4.0, 0.0)])
@pytest.mark.parametrize("subset", [None, "classes"])
def test_image_iteration_follows_the_order_function(folders, subset, weights):
    path = folders / "img" if subset is None else shards.SourceSpec(str(folders / "img"),
                                                                   subset=shards.Subset(classes=["a", "b"]))
    dataset = shards.open_dataset(path, "train", seed=4,
                                  return_keys=True,
                                  decode=shards.Decode(decoder=lambda sample, seed: 0),
                                  sampling=shards.Sampling(shuffle_buffer=5, class_weights=weights),
                                  distributed=shards.Distributed(rank=1, world_size=2))
    for worker in range(3):
        got = [int(key.split("_")[1]) for _, _, key in dataset.worker_stream(StreamJob(2, worker, 3, split_batch=2))]
        assert got == dataset.worker_order(2, worker, 3, split_batch=2).served().tolist()
        assert got  # every worker of this layout reads something


def test_the_order_is_a_pure_function_of_its_inputs(folders):
    case = layout(7)
    first = open_features(folders, case, 0).worker_order(1, 0, 2, split_batch=3).served()
    again = open_features(folders, case, 0).worker_order(1, 0, 2, split_batch=3).served()
    other = open_features(folders, {**case, "seed": case["seed"] + 1}, 0).worker_order(1, 0, 2, split_batch=3)
    assert np.array_equal(first, again)
    if case["shuffle"]:
        assert not np.array_equal(first, other.served())


def test_images_and_features_get_one_loader_type(folders):
    """One type with one cursor: whatever makes the batches, a training loop or checkpoint sees the same methods."""
    from shards.loader.base import Loader

    features = shards.open_dataset(folders / "a", "train")
    images = shards.open_dataset(folders / "img", "train", decode=shards.Decode(decoder=lambda sample, seed: 0))
    loaders = [shards.make_loader(features, 4), shards.make_loader(features, 4, mode=WorkerProcesses(1)),
               shards.make_loader(images, 4, mode=InProcess())]
    assert {type(loader) for loader in loaders} == {Loader}
    assert [loader.mode for loader in loaders] == [InProcess(), WorkerProcesses(1), InProcess()]
    assert [loader.state_dict()["kind"] for loader in loaders] == ["feature_batches", "stream", "stream"]
    for loader in loaders:
        batches = list(loader)
        assert len(batches) == len(loader)
        state = loader.state_dict()
        assert state["batches"] == len(loader) and state["epoch"] == 0
        with pytest.raises(shards_errors.InputError, match="batch_size"):
            Loader(loader.dataset, 0, loader.mode)


@pytest.mark.parametrize("index", range(CASES))
@pytest.mark.slow
def test_a_windowed_order_keeps_every_row_in_its_window(folders, index):
    """``feature_window=n``: the in-process loader's k-th n served rows are exactly the k-th n rows of the rank's
    share as read (the shuffled shards front to back), permuted; without a window the share is permuted whole."""
    case = {**layout(index), "shuffle": True, "window": random.Random(index).choice([1, 3, 8, 100])}
    window = case["window"]
    for rank in range(case["world"]):
        order = open_features(folders, case, rank).worker_order(case["epoch"], 0, 1, whole=True)
        served, read = order.served(), order.rows
        assert sorted(served.tolist()) == sorted(read.tolist())
        for start in range(0, len(read), window):
            assert sorted(served[start:start + window].tolist()) == sorted(read[start:start + window].tolist())
        again = open_features(folders, case, rank).worker_order(case["epoch"], 0, 1, whole=True).served()
        assert np.array_equal(served, again)  # seeded: the same inputs give the same order
        if window >= 8 and len(set(read[:window].tolist())) > 3:
            later = open_features(folders, case, rank).worker_order(case["epoch"] + 1, 0, 1, whole=True)
            assert not np.array_equal(served, later.served())  # a new epoch, a new order


@pytest.mark.parametrize("index", range(0, CASES, 2))
def test_replay_finds_what_the_in_process_feature_loader_left(folders, index):
    """The in-process loader (a whole or windowed permutation) stopped on every rank after the same random number
    of batches: replay says the rows left are the epoch's rows no rank had served, as a multiset."""
    case = layout(index)
    rng = random.Random(2000 + index)
    consumed, stop = collections.Counter(), None
    for rank in range(case["world"]):
        dataset = open_features(folders, case, rank)
        dataset.set_epoch(case["epoch"])
        loader = shards.make_loader(dataset, case["batch"], drop_last=False)
        stop = rng.randint(0, len(loader)) if stop is None else stop
        batches = iter(loader)
        for _ in range(stop):
            consumed.update(combined_row(dataset, row[0]) for row in next(batches)[0])
        state = LoaderState.from_dict(loader.state_dict())
        source = dataset.epoch_source()
    left = remaining_after(source, SavedState.of(state))
    expected = collections.Counter(source.epoch_stream(case["epoch"], case["world"], 1).tolist())
    expected.subtract(consumed)
    assert collections.Counter(left.tolist()) == +expected, case


# -- class weighting: one step of the order, drawn before any worker takes its share -------------------------------
def weighted(case: dict) -> dict:
    """``case`` with class weights (a layout drawn without them gets some, from its seed)."""
    if case["weights"]:
        return case
    return {**case, "weights": random.Random(case["seed"]).choice(["balanced", (1.0, 0.0, 3.0), (5.0, 1.0, 1.0)])}


@pytest.mark.parametrize("index", range(0, CASES, 2))
@pytest.mark.slow
def test_weighted_draws_do_not_depend_on_the_number_of_workers(folders, index):
    """Each worker's rows, in worker order, are the rank's rows as one worker reads them; what a DataLoader's round
    robin over 1, 2 or 3 workers yields, and what the in-process loader serves, are the rank's draws (as a
    multiset: the yield order is each mode's shuffle of them)."""
    case = weighted(layout(index))
    for rank in range(case["world"]):
        dataset = open_features(folders, case, rank)
        rank_rows = dataset.worker_order(case["epoch"], 0, 1).rows
        draws = collections.Counter(rank_rows.tolist())
        assert collections.Counter(dataset.worker_order(case["epoch"], 0, 1, whole=True).served().tolist()) == draws
        for workers in (1, 2, 3):
            parts = [dataset.worker_order(case["epoch"], w, workers, split_batch=case["batch"]).rows
                     for w in range(workers)]
            assert np.concatenate(parts).tolist() == rank_rows.tolist(), case
            streams = [yielded_rows(dataset, case["epoch"], w, workers, case["batch"]) for w in range(workers)]
            fed = dataloader_consumed(streams, case["batch"], False, sum(len(s) for s in streams))
            assert collections.Counter(fed) == draws, case


@pytest.mark.parametrize("index", range(0, CASES, 4))
@pytest.mark.slow
def test_a_weighted_order_is_a_pure_function_of_seed_and_epoch(folders, index):
    case = weighted(layout(index))

    def stream(seed: int, epoch: int) -> tuple:
        source = open_features(folders, {**case, "seed": seed}, 0).epoch_source()
        return tuple(source.epoch_stream(epoch, case["world"], 1).tolist())

    first = stream(case["seed"], case["epoch"])
    assert first == stream(case["seed"], case["epoch"])  # the same inputs, the same draws
    if case["shuffle"]:  # a few dozen rows may draw alike from every offset; the shard order differs anyway
        assert len({stream(case["seed"] + k, case["epoch"]) for k in range(5)}) > 1  # other seeds, other draws
        assert len({stream(case["seed"], case["epoch"] + k) for k in range(5)}) > 1  # other epochs, other draws


def test_class_frequencies_approach_the_weights():
    """Over 20 epochs the drawn classes match ``weight * count`` shares. Each row is drawn the floor or the ceiling
    of its expected count per epoch (systematic resampling), so a class's total misses its expectation by a sum of
    per-row errors in (-1, 1), of variance at most 1/4 each: its standard deviation over the epochs is at most
    sqrt(epochs * rows / 4), and five of them is a loose bound (the seed is fixed: the check is deterministic)
    that an unweighted stream (the rarest class 60 a epoch instead of about 460) misses by far."""
    labels = np.random.default_rng(0).choice(4, size=3000, p=[0.7, 0.2, 0.08, 0.02])
    weights = (1.0, 2.0, 0.0, 10.0)
    source = EpochSource((500,) * 6, seed=11, shuffle=True, shuffle_buffer=64, drop_last=False,
                         class_weights=weights, labels=labels)
    epochs = 20
    drawn = np.bincount(np.concatenate([labels[source.epoch_stream(e, 1, 1)] for e in range(epochs)]), minlength=4)
    counts = np.bincount(labels, minlength=4)
    mass = counts * np.asarray(weights)
    expected = epochs * len(labels) * mass / mass.sum()
    assert drawn.sum() == epochs * len(labels)  # the epoch keeps its length
    assert np.all(np.abs(drawn - expected) <= 5 * np.sqrt(epochs * counts / 4)), (drawn, expected)
    assert drawn[2] == 0  # weight 0: never drawn
    unshuffled = replace(source, shuffle=False)  # the same stream every epoch: only the draws can differ
    assert np.array_equal(unshuffled.epoch_stream(3, 1, 1), unshuffled.epoch_stream(3, 1, 1))
    assert not np.array_equal(unshuffled.epoch_stream(3, 1, 1), unshuffled.epoch_stream(4, 1, 1))
    assert not np.array_equal(unshuffled.epoch_stream(3, 1, 1), replace(unshuffled, seed=12).epoch_stream(3, 1, 1))


def test_weights_without_a_column_index_are_one_line_naming_the_folder(tmp_path):
    make_shard_dataset(tmp_path / "old", shard_sizes={"train": [4, 3]}, size=(8, 8))
    with pytest.raises(shards_errors.InputError) as caught:
        shards.open_dataset(tmp_path / "old", sampling=shards.Sampling(class_weights="balanced"))
    message = str(caught.value)
    assert str(tmp_path / "old") in message and "column index" in message and "\n" not in message


def test_a_weighted_image_mixture_draws_by_the_combined_classes(folders, tmp_path):
    """Each source's labels come from its own column index, mapped onto the mixture's classes (``union``: a, b,
    c, d here), so a weight names a combined class whichever source holds it."""
    make_shard_dataset(tmp_path / "other", classes=("b", "c", "d"), shard_sizes={"train": [6, 4]}, size=(8, 8))
    add_label_columns(tmp_path / "other")
    dataset = shards.open_dataset([folders / "img", tmp_path / "other"], "train", seed=2, return_keys=True,
                                  decode=shards.Decode(decoder=lambda sample, seed: 0),
                                  sampling=shards.Sampling(shuffle_buffer=4, class_weights=(0.0, 1.0, 0.0, 2.0)),
                                  mix=shards.MixOptions(class_map="union"))
    assert dataset.mixture.classes == ("a", "b", "c", "d")
    order = dataset.worker_order(0, 0, 1)
    yielded = [(label, key) for _, label, key in dataset.worker_stream(StreamJob(0, 0, 1))]
    assert {label for label, _ in yielded} == {1, 3}  # only b (from both sources) and d (from the second)
    assert [label for label, _ in yielded] == dataset.row_labels[order.served()].tolist()
    assert len(yielded) == len(dataset)  # the epoch keeps its length
