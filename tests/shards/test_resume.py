"""Exact mid-epoch resume: a fresh reader loaded with the state yields exactly what the epoch had left, in order."""

import pytest
import torch

import shards
from shards.position.resume import LOADER_STATE_VERSION, LoaderState
from shards.loader.threads import Threads
from shards.loader.worker_processes import WorkerProcesses
from shards.loader.loader import workers_mode
from tests.helpers import make_shard_dataset
from tests.shards.budget_helpers import smallest_budget
from tests.shards.label_columns import add_label_columns
from tests.shards.stream_helpers import write_feature_dataset

SIZES = {"train": [7, 5, 9, 3, 6]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume")
    make_shard_dataset(out, shard_sizes=SIZES, size=(16, 16))
    add_label_columns(out)
    return out


def build(folder, workers, run="processes", memory=None, **options):
    dataset = shards.open_dataset(folder, transform="eval", return_keys=True, seed=3,
                                  sampling=shards.Sampling(shuffle_buffer=6), **options)
    mode = workers_mode(workers, persistent=False, run=run) if workers else workers_mode(0)
    return shards.make_loader(dataset, batch_size=4, mode=mode, drop_last=False, memory=memory)


def key_batches(iterable):
    return [list(batch[2]) for batch in iterable]


SLOW = pytest.mark.slow


@pytest.mark.parametrize("workers,run,small", [
    (0, "processes", False), pytest.param(1, "processes", False, marks=SLOW),
    pytest.param(2, "processes", False, marks=SLOW), pytest.param(3, "processes", False, marks=SLOW),
    (1, "threads", False), (2, "threads", False), (3, "threads", False),
    # the smallest memory budget each works in: fewer batches in flight, the same keys in the same order
    pytest.param(0, "processes", True, marks=SLOW), pytest.param(2, "processes", True, marks=SLOW),
    (3, "threads", True)],
    ids=lambda value: ("small-budget" if value else "unbudgeted") if type(value) is bool else str(value))
def test_resume_yields_exactly_the_rest(folder, workers, run, small):
    reference = build(folder, workers, run)
    reference.set_epoch(2)
    full = key_batches(reference)
    memory = smallest_budget(lambda memory: build(folder, workers, run, memory)) if small else None
    for taken in (1, 3, len(full) - 1):
        interrupted = build(folder, workers, run, memory)
        interrupted.set_epoch(2)
        iterator = iter(interrupted)
        head = [list(next(iterator)[2]) for _ in range(taken)]
        state = interrupted.state_dict()
        del iterator
        resumed = build(folder, workers, run, memory)
        resumed.load_state_dict(state)
        assert resumed.epoch == 2
        assert head + key_batches(resumed) == full


# The replay is the same in both modes; the processes one (two process starts per loader) runs in the full suite.
@pytest.mark.parametrize("mode", [pytest.param(WorkerProcesses(2, persistent=False), marks=SLOW), Threads(2)],
                         ids=["processes", "threads"])
def test_resume_replays_class_weights_and_augmentations(folder, mode):
    def loader():
        dataset = shards.open_dataset(folder, transform="train", return_keys=True, seed=5,
                                      sampling=shards.Sampling(class_weights="balanced"))
        return shards.make_loader(dataset, batch_size=3, mode=mode, drop_last=True)

    full = [(b[0], list(b[2])) for b in loader()]
    interrupted = loader()
    iterator = iter(interrupted)
    for _ in range(4):
        next(iterator)
    state = interrupted.state_dict()
    resumed = [(b[0], list(b[2])) for b in _loaded(loader(), state)]
    assert [k for _, k in resumed] == [k for _, k in full[4:]]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(resumed, full[4:]))


def _loaded(loader, state):
    loader.load_state_dict(state)
    return loader


def test_next_epoch_after_resume_is_a_full_epoch(folder):
    # Threads here and below: the rule is the cursor's, the same in every run mode, and no process starts.
    loader = build(folder, 2, "threads")
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    resumed = build(folder, 2, "threads")
    resumed.load_state_dict(state)
    list(resumed)
    resumed.set_epoch(1)
    assert sum(len(b) for b in key_batches(resumed)) == 30


def test_dataset_state_without_loader(folder):
    dataset = shards.open_dataset(folder, return_keys=True, seed=2)
    full = [key for _, _, key in dataset]
    iterator = iter(dataset)
    head = [next(iterator)[2] for _ in range(11)]
    state = dataset.state_dict()
    fresh = shards.open_dataset(folder, return_keys=True, seed=2)
    fresh.load_state_dict(state)
    assert head + [key for _, _, key in fresh] == full


def test_resume_with_another_seed_dataset_or_order_is_refused_in_one_line(folder, tmp_path):
    state = build(folder, 2).state_dict()
    make_shard_dataset(tmp_path, shard_sizes={"train": [7, 5, 9, 3, 7]}, size=(16, 16))
    other_seed = shards.make_loader(shards.open_dataset(folder, seed=99), batch_size=4, mode=WorkerProcesses(2))
    other_data = build(tmp_path, 2)
    other_order = shards.make_loader(shards.open_dataset(folder, seed=3), batch_size=4, mode=WorkerProcesses(2))
    for loader, match in ((other_seed, "seed"), (other_data, "another dataset"), (other_order, "sampling")):
        with pytest.raises(shards.errors.InputError, match=match) as caught:
            loader.load_state_dict(state)
        assert "\n" not in str(caught.value)


# -- the saved layout --------------------------------------------------------------------------------------------
def test_state_is_a_versioned_layout_without_the_rank(folder):
    state = build(folder, 2).state_dict()
    assert state["version"] == LOADER_STATE_VERSION and state["kind"] == "stream"
    assert "rank" not in state  # every rank consumes an equal share: rank 0's state continues every rank
    audit = state.pop("audit")  # beside the position: the keys this rank fed and has next (test_resume_audit.py)
    assert audit["rank"] == 0 and LoaderState.from_dict(state).to_dict() == state


@pytest.mark.parametrize("version", [99, 1, None])
def test_a_state_of_another_version_is_refused_in_one_line(folder, version):
    # 1: workers split sample by sample; None: saved before states had versions. Neither is guessed at.
    state = {**build(folder, 2).state_dict(), "version": version}
    if version is None:
        del state["version"]
    with pytest.raises(shards.errors.InputError, match=f"version {version!r} is not one") as caught:
        build(folder, 2).load_state_dict(state)
    assert "\n" not in str(caught.value)


def test_a_dataset_state_from_before_versions_is_refused(folder):
    fresh = shards.open_dataset(folder, return_keys=True, seed=2)
    with pytest.raises(shards.errors.InputError, match="version None"):
        fresh.load_state_dict({"epoch": 0, "samples": 11, "num_workers": 0, "seed": 2, "world_size": 1, "rank": 0})


def test_a_state_of_another_kind_of_loader_is_refused(folder):
    state = {**build(folder, 2).state_dict(), "kind": "feature_batches"}
    with pytest.raises(shards.errors.InputError, match="kind=feature_batches"):
        build(folder, 2).load_state_dict(state)


def test_state_after_the_batches_a_lagging_consumer_used(folder):
    full = key_batches(build(folder, 2, "threads"))
    ahead = build(folder, 2, "threads")
    iterator = iter(ahead)
    for _ in range(5):  # a prefetcher drew five batches; the consumer used two
        next(iterator)
    state = ahead.state_dict(batches_consumed=2)
    with pytest.raises(shards.errors.InputError, match="batches_consumed"):
        ahead.state_dict(batches_consumed=6)
    del iterator
    resumed = build(folder, 2, "threads")
    resumed.load_state_dict(state)
    assert key_batches(resumed) == full[2:]


# -- augmentation seeds ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pipeline", ["standard", "fast"])
def test_the_reader_leaves_torchs_global_generator_alone(folder, pipeline):
    dataset = shards.open_dataset(folder, transform="train", seed=4, decode=shards.Decode(pipeline))
    before = torch.random.get_rng_state()
    first = [image for image, _ in dataset]
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.manual_seed(1234)  # whatever the caller does with the global generator, the augmentations stay
    again = [image for image, _ in dataset]
    assert all(torch.equal(_as_tensor(a), _as_tensor(b)) for a, b in zip(first, again))


def _as_tensor(image):
    from torchvision.transforms.functional import pil_to_tensor

    return image if isinstance(image, torch.Tensor) else pil_to_tensor(image)


def test_decoder_gets_a_per_sample_seed_that_a_resume_replays(folder):
    def dataset():
        return shards.open_dataset(folder, seed=6, decode=shards.Decode(decoder=lambda sample, seed: seed))

    full = [seed for seed, _ in dataset()]
    assert len(set(full)) == len(full) and full == [seed for seed, _ in dataset()]
    interrupted = dataset()
    iterator = iter(interrupted)
    for _ in range(9):
        next(iterator)
    resumed = dataset()
    resumed.load_state_dict(interrupted.state_dict())
    assert [seed for seed, _ in resumed] == full[9:]


def numpy_and_python_augment(image):
    """An albumentations-style transform: its randomness from NumPy's and Python's global generators."""
    import random

    import numpy as np

    return torch.tensor([np.random.rand(), random.random()])


@pytest.mark.parametrize("mode", [pytest.param(WorkerProcesses(2, persistent=False), marks=SLOW), "in-process"],
                         ids=["processes", "in-process"])
def test_numpy_and_python_draws_are_seeded_per_sample_and_leave_the_callers_state(folder, mode):
    """A resumed epoch fed the same keys with other augmentations (the transform's draws were not seeded), and in
    the training process the transform moved the caller's own NumPy and Python random state."""
    import random

    import numpy as np

    def loader():
        dataset = shards.open_dataset(folder, transform=numpy_and_python_augment, return_keys=True, seed=7)
        return shards.make_loader(dataset, batch_size=3, mode=None if mode == "in-process" else mode,
                                  num_workers=0 if mode == "in-process" else None, drop_last=False)

    np.random.seed(11)
    random.seed(11)
    numpy_before, python_before = np.random.get_state()[1].copy(), random.getstate()
    full = [(b[0], list(b[2])) for b in loader()]
    assert np.array_equal(np.random.get_state()[1], numpy_before) and random.getstate() == python_before
    interrupted = loader()
    iterator = iter(interrupted)
    for _ in range(3):
        next(iterator)
    state = interrupted.state_dict()
    np.random.seed(99)  # whatever the caller draws meanwhile, the augmentations stay
    resumed = [(b[0], list(b[2])) for b in _loaded(loader(), state)]
    assert [k for _, k in resumed] == [k for _, k in full[3:]]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(resumed, full[3:]))
    assert len({tuple(row.tolist()) for batch, _ in full for row in batch}) == sum(len(k) for _, k in full)
