"""Class-weighted streaming: balanced class frequencies from an imbalanced split, seeded, epoch length unchanged, the
same draws through any loader."""

import collections

import numpy as np
import pytest

import shards
from shards.errors import InputError
from shards.stream.options import Sampling
from shards.loader.loader import workers_mode
from shards.order.plan import rng_for
from shards.order.weights import systematic_resample
from tests.shards.label_columns import add_label_columns
from tests.shards.stream_helpers import write_labelled_shards

# 60 / 24 / 12 samples of classes a / b / c over uneven shards, classes interleaved as a packer's shuffle would.
LABELS = [0] * 60 + [1] * 24 + [2] * 12


@pytest.fixture(scope="module")
def imbalanced(tmp_path_factory):
    folder = tmp_path_factory.mktemp("imbalanced")
    order = np.random.default_rng(0).permutation(LABELS).tolist()
    write_labelled_shards(folder, [order[:40], order[40:70], order[70:]], size=(8, 8))
    add_label_columns(folder)
    return folder


def labels_over(dataset, epochs):
    out = []
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        out += [label for _, label, _ in dataset]
    return out


def test_balanced_weights_even_out_class_frequencies(imbalanced):
    dataset = shards.open_dataset(imbalanced, return_keys=True, seed=1,
                                  sampling=Sampling(class_weights="balanced"))
    labels = labels_over(dataset, 4)
    assert len(labels) == 4 * len(LABELS)  # epoch length unchanged
    shares = [labels.count(c) / len(labels) for c in range(3)]
    assert all(abs(share - 1 / 3) < 0.06 for share in shares), shares
    plain = labels_over(shards.open_dataset(imbalanced, return_keys=True, seed=1), 1)
    assert plain.count(2) / len(plain) == pytest.approx(12 / 96)


def test_given_weights_and_seed_reproducibility(imbalanced):
    def run(seed):
        return [key for _, _, key in shards.open_dataset(imbalanced, return_keys=True, seed=seed,
                                                         sampling=Sampling(class_weights=[0, 1, 1]))]
    keys = run(3)
    assert keys == run(3) and keys != run(4)
    assert len(keys) == 96
    dataset = shards.open_dataset(imbalanced, return_keys=True, seed=3,
                                  sampling=Sampling(class_weights=[0, 1, 1]))
    assert {label for _, label, _ in dataset} == {1, 2}  # weight 0: class a is never drawn


def test_systematic_resample_counts_are_floor_or_ceiling_of_expectation():
    labels = np.asarray([0] * 6 + [1] * 2 + [2])
    for seed in range(20):
        picked = systematic_resample(labels, [1.0, 3.0, 6.0], rng_for(seed, 1))
        counts = collections.Counter(labels[i] for i in picked)
        expected = {0: 9 * 6 / 18, 1: 9 * 6 / 18, 2: 9 * 6 / 18}
        assert all(abs(counts[c] - expected[c]) < 1.0 + 1e-9 for c in expected)
        assert len(picked) == len(labels)
        assert np.all(np.diff(picked) >= 0)  # the stream's order kept: the shuffle after it mixes the draws
        per_row = np.bincount(picked, minlength=len(labels))
        row_expected = 9 * np.asarray([1.0, 3.0, 6.0])[labels] / 18
        assert np.all((per_row == np.floor(row_expected)) | (per_row == np.ceil(row_expected)))


def test_bad_weights_are_refused(imbalanced):
    with pytest.raises(InputError, match="3 classes"):
        shards.open_dataset(imbalanced, sampling=Sampling(class_weights=[1, 2]))
    with pytest.raises(InputError, match="balanced"):
        shards.open_dataset(imbalanced, sampling=Sampling(class_weights="inverse"))


@pytest.mark.parametrize("options,field", [({"shuffle_buffer": -1}, "Sampling.shuffle_buffer"),
                                           ({"class_weights": "inverse"}, "Sampling.class_weights"),
                                           ({"class_weights": [0, 0]}, "Sampling.class_weights"),
                                           ({"class_weights": [1, -1]}, "Sampling.class_weights")])
def test_bad_sampling_is_one_line_naming_the_field(options, field):
    with pytest.raises(InputError) as info:
        Sampling(**options)
    assert str(info.value).startswith(field) and "\n" not in str(info.value)


def test_sampling_weights_become_a_tuple():
    assert Sampling(class_weights=[0, 1, 2]).class_weights == (0.0, 1.0, 2.0)


def test_workers_and_no_workers_draw_the_same_epoch(imbalanced):
    """The draws are the order's, made before the workers' split: 0 or 2 worker processes yield the same keys
    the same number of times (a key may come more than once), and the epoch keeps its length."""
    def drawn(workers):
        dataset = shards.open_dataset(imbalanced, return_keys=True, seed=2,
                                      decode=shards.Decode(decoder=lambda sample, seed: 0),
                                      sampling=Sampling(class_weights="balanced", shuffle_buffer=8))
        loader = shards.make_loader(dataset, batch_size=5, mode=workers_mode(workers, persistent=False),
                                    drop_last=False)
        return collections.Counter(key for batch in loader for key in batch[2])

    zero = drawn(0)
    assert zero == drawn(2)
    assert sum(zero.values()) == len(LABELS) and max(zero.values()) > 1


def test_a_weighted_epoch_resumes_mid_epoch_exactly(imbalanced):
    """The draws are known before anything is read, so a resumed worker starts at the rows still to come
    (``WorkerOrder.after``), and the resumed epoch yields exactly the batches the interrupted one had left."""
    def loader():
        dataset = shards.open_dataset(imbalanced, return_keys=True, seed=4,
                                      decode=shards.Decode(decoder=lambda sample, seed: seed),
                                      sampling=Sampling(class_weights=[1, 2, 6], shuffle_buffer=8))
        return shards.make_loader(dataset, batch_size=4, mode=workers_mode(0), drop_last=False)

    full = [(list(batch[2]), batch[0].tolist()) for batch in loader()]
    interrupted = loader()
    batches = iter(interrupted)
    for _ in range(7):
        next(batches)
    state = interrupted.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert [(list(batch[2]), batch[0].tolist()) for batch in resumed] == full[7:]  # keys and augmentation seeds
