"""``Threads`` and a callable transform (``shards.stream.transform_probe``): one that draws nothing from a global
random generator on the first samples runs in threads, the trainer's generator untouched, and ``Auto`` tries threads
with it; one that draws (torch's, Python's ``random``, NumPy's) is refused by name with the fix."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
import torchvision.transforms as T

import shards
from shards.errors import InputError
from shards.loader.auto import Auto
from shards.loader.in_process import InProcess
from shards.loader.loader import make_loader
from shards.loader.threads import Threads
from shards.loader.worker_processes import WorkerProcesses
from tests.helpers import make_shard_dataset

EVAL = [T.Resize(14), T.CenterCrop(12), T.ToTensor(), T.Normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    make_shard_dataset(root, shard_sizes={"train": [6, 5]}, size=(20, 16))
    return root


def opened(folder, transform):
    return shards.open_dataset(folder, "train", seed=2, transform=transform, return_keys=True)


def by_key(loader) -> dict[str, torch.Tensor]:
    return {key: image.clone() for batch in loader for image, key in zip(batch[0], batch[2])}


def test_a_deterministic_compose_runs_in_threads_and_feeds_what_the_seeded_path_feeds(folder):
    threaded = opened(folder, T.Compose(EVAL))
    loader = make_loader(threaded, 4, mode=Threads(2), drop_last=False)
    assert threaded.decoder.draws_nothing
    reference = opened(folder, T.Compose(EVAL))  # never probed: each sample under a seeded fork of the generator
    assert not reference.decoder.draws_nothing
    got, want = by_key(loader), by_key(make_loader(reference, 4, mode=InProcess(), drop_last=False))
    assert len(got) == 11 and got.keys() == want.keys()
    assert all(torch.equal(got[key], want[key]) for key in got)


class SeedSeen:
    """Draws nothing; records the seed torch's default generator was last seeded with as it runs."""

    def __init__(self):
        self.seen = []

    def __call__(self, image):
        self.seen.append(torch.initial_seed())
        return T.functional.pil_to_tensor(image)


def test_in_threads_a_transform_that_draws_nothing_runs_on_the_trainers_generator_untouched(folder):
    transform = SeedSeen()
    dataset = opened(folder, transform)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    loader = make_loader(dataset, 4, mode=Threads(2), drop_last=False)
    assert sum(len(b[1]) for b in loader) == 11
    # The probe's calls ran under a fork of the generator; the loader threads' calls saw the trainer's own seed,
    # not a per-sample reseed (which is what would race the training step).
    assert transform.seen[-11:] == [1234] * 11
    assert torch.equal(torch.get_rng_state(), state)


def test_a_transform_that_draws_from_torch_is_refused_naming_the_step_and_the_fix(folder):
    dataset = opened(folder, T.Compose([T.Resize(14), T.RandomResizedCrop(12), T.ToTensor()]))
    state = torch.get_rng_state()
    with pytest.raises(InputError) as raised:
        make_loader(dataset, 4, mode=Threads(2))
    message = str(raised.value)
    assert "\n" not in message and "RandomResizedCrop draws from torch's global random generator" in message
    assert "TransformSpec" in message and "WorkerProcesses(n)" in message
    assert torch.equal(torch.get_rng_state(), state)  # the probe's own draws were undone
    assert not dataset.decoder.draws_nothing
    assert make_loader(dataset, 4, mode=WorkerProcesses(1)).mode == WorkerProcesses(1)


class PythonDraw:
    def __call__(self, image):
        random.random()
        return T.functional.pil_to_tensor(image)


class NumpyDraw:
    def __call__(self, image):
        np.random.rand()
        return T.functional.pil_to_tensor(image)


@pytest.mark.parametrize("transform, generator", [(PythonDraw(), "Python's global random generator (random)"),
                                                  (NumpyDraw(), "NumPy's global random generator (np.random)")])
def test_draws_from_pythons_or_numpys_global_state_are_refused_too(folder, transform, generator):
    python_state, numpy_state = random.getstate(), np.random.get_state()
    expected = f"the transform's {type(transform).__name__} draws from {generator}"
    with pytest.raises(InputError, match=re.escape(expected)):
        make_loader(opened(folder, transform), 4, mode=Threads(1))
    assert random.getstate() == python_state and np.array_equal(np.random.get_state()[1], numpy_state[1])


def test_auto_tries_threads_with_a_transform_that_draws_nothing_and_not_with_one_that_draws(folder):
    clean = make_loader(opened(folder, T.Compose(EVAL)), 4, mode=Auto(1, trial_batches=2, warmup_batches=0))
    assert Threads(1) in clean.run.candidates
    drawing = make_loader(opened(folder, T.Compose([T.RandomHorizontalFlip(), T.ToTensor()])), 4,
                          mode=Auto(1, trial_batches=2, warmup_batches=0))
    assert Threads(1) not in drawing.run.candidates and WorkerProcesses(1) in drawing.run.candidates
