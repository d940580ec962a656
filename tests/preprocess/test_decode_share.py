"""``--decode auto``'s split between the model's device and the CPU workers (``preprocess.features.decode_share``):
the share from injected costs (no timing here), decided every N batches, p99-aware, with hysteresis, the same for
the same measurements; and on a machine without an accelerator, ``auto`` is the workers' fast path."""

from __future__ import annotations

import logging

import pytest
import torch

from preprocess.features.decode_share import (BatchCosts, ShareControl, ShareController, best_share,
                                              predicted_step, quantile, resolve_auto)
from preprocess.features.featurize import FeatureConfig, precompute_features
from shards.errors import InputError
from shards.formats.features import load_feature_shard
from tests.helpers import make_shard_dataset

SMALL = dict(backbone="resnet18", weights="none", resize=40, crop=32, batch_size=4, dtype="float32", quiet=True)


def costs(device_s, cpu_s, forward_s=0.01, images=64):
    return BatchCosts(device_s, cpu_s, forward_s, images)


def run(controller, batches):
    return [controller.observe(b) for b in batches]


def test_the_best_share_balances_the_two_sides_and_is_the_grids_argmin():
    shares = ShareControl().shares()
    for device_s, cpu_s, forward_s in [(1e-4, 1e-3, 0.01), (1e-3, 1e-4, 0.01), (2e-4, 2e-4, 0.0), (5e-5, 8e-4, 0.03)]:
        chosen = best_share(shares, device_s, cpu_s, forward_s, 64)
        steps = [predicted_step(s, device_s, cpu_s, forward_s, 64) for s in shares]
        assert predicted_step(chosen, device_s, cpu_s, forward_s, 64) == min(steps)
    assert best_share(shares, 1e-5, 1e-3, 0.0, 64) > 0.9  # a fast device takes nearly all
    assert best_share(shares, 1e-3, 1e-5, 0.0, 64) < 0.1  # fast workers take nearly all
    assert best_share(shares, 1e-4, 1e-4, 0.0, 64) == 0.5  # equal costs, nothing else on the device: half each
    # the device's own work (the forward) leaves it less room to decode
    assert best_share(shares, 1e-4, 1e-4, 0.002, 64) < 0.5


def test_decisions_come_every_n_batches_from_the_batches_since_the_last():
    controller = ShareController(ShareControl(every=4, start=0.5))
    assert run(controller, [costs(1e-5, 1e-3, 0.0)] * 3) == [0.5] * 3  # not yet decided
    assert controller.observe(costs(1e-5, 1e-3, 0.0)) > 0.9  # fourth batch: the device is far faster
    high = controller.share
    # the workers get faster (another job left the node): re-measured, the share moves back
    shares = run(controller, [costs(1e-3, 1e-5, 0.0)] * 4)
    assert shares[:3] == [high] * 3 and shares[3] < 0.1
    assert [batch for batch, _ in controller.history] == [0, 4, 8]


def test_the_same_measurements_give_the_same_shares():
    import random

    rng = random.Random(5)
    batches = [costs(rng.uniform(1e-5, 1e-3), rng.uniform(1e-5, 1e-3), rng.uniform(0, 0.02), rng.choice([32, 64]))
               for _ in range(200)]
    first, second = ShareController(ShareControl(every=8)), ShareController(ShareControl(every=8))
    assert run(first, batches) == run(second, batches)
    assert first.history == second.history and first.record() == second.record()


def test_hysteresis_keeps_the_share_when_the_gain_is_small():
    control = ShareControl(every=2, hysteresis=0.05, grid=32, start=0.5)
    controller = ShareController(control)
    # predicted step at 0.5: max(32*1.0e-4 + 0, 32*1.05e-4) = 3.36 ms; the best share gains ~2.4%: kept
    run(controller, [costs(1.0e-4, 1.05e-4, 0.0)] * 2)
    assert controller.share == 0.5 and controller.history == [(0, 0.5)]
    run(controller, [costs(1.0e-4, 2.0e-4, 0.0)] * 2)  # now a third shorter: taken
    assert controller.share > 0.6 and len(controller.history) == 2


def test_the_slower_sides_tail_moves_the_share_where_the_mean_would_not():
    """Same mean cost on both sides, but one CPU batch in ten is slow: balancing the tails gives the device more."""
    cpu = [1e-4] * 9 + [5e-4]
    device = [1.4e-4] * 10
    tail = ShareController(ShareControl(every=10, tail=0.99))
    run(tail, [costs(d, c, 0.0) for d, c in zip(device, cpu)])
    mean = best_share(ShareControl().shares(), sum(device) / 10, sum(cpu) / 10, 0.0, 64)
    assert tail.share > mean
    # its predicted p99 step is shorter than the mean-balanced share's
    p99 = dict(device_s=quantile(device, 0.99), cpu_s=quantile(cpu, 0.99), forward_s=0.0, images=64)
    assert predicted_step(tail.share, **p99) < predicted_step(mean, **p99)


def test_a_side_that_decoded_nothing_keeps_its_last_cost_and_both_keep_a_probe_share():
    controller = ShareController(ShareControl(every=2))
    run(controller, [costs(1e-4, 1e-4)] * 2)
    before = controller.record()["costs_s"]["cpu_s"]
    run(controller, [costs(1e-4, None)] * 2)
    assert controller.record()["costs_s"]["cpu_s"] == before
    run(controller, [costs(1e-7, 1.0, 0.0)] * 2)
    assert controller.share == 1 - controller.control.probe  # never all: the workers stay measured
    run(controller, [costs(1.0, 1e-7, 0.0)] * 2)
    assert controller.share == controller.control.probe


@pytest.mark.parametrize("make, message", [
    (lambda: BatchCosts(-1.0, 0.1, 0.0, 4), "device_s"),
    (lambda: BatchCosts(0.1, float("nan"), 0.0, 4), "cpu_s"),
    (lambda: BatchCosts(0.1, 0.1, 0.0, 0), "images"),
    (lambda: ShareControl(every=0), "every"),
    (lambda: ShareControl(tail=0.2), "tail"),
    (lambda: ShareControl(grid=1), "grid"),
    (lambda: ShareControl(start=1.0), "start"),
])
def test_bad_settings_and_measurements_are_refused_in_one_line(make, message):
    with pytest.raises(InputError, match=message) as raised:
        make()
    assert "\n" not in str(raised.value)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    make_shard_dataset(root, shard_sizes={"train": [5, 4]}, storage="tar", size=(200, 160))
    return root


def test_auto_without_an_accelerator_is_the_fast_path_and_says_so(data_dir, tmp_path, caplog):
    cfg = FeatureConfig(data_dir, tmp_path / "x", decode="auto", **SMALL)
    with caplog.at_level(logging.INFO, logger="preprocess.features.decode_share"):
        resolved = resolve_auto(cfg, torch.device("cpu"))
    assert resolved.decode == "fast" and resolved.out_dir == cfg.out_dir
    lines = [r.getMessage() for r in caplog.records if "--decode auto" in r.getMessage()]
    assert len(lines) == 1 and "no accelerator" in lines[0]
    assert resolve_auto(cfg, torch.device("cuda")).decode == "auto"  # the consumer measures the split there
    augmenting = FeatureConfig(data_dir, tmp_path / "z", decode="auto", views=1, augment=True, **SMALL)
    assert resolve_auto(augmenting, torch.device("cpu")).decode == "fast"
    with pytest.raises(InputError, match="with --augment use --decode device or --decode fast"):
        resolve_auto(augmenting, torch.device("cuda"))
    assert resolve_auto(FeatureConfig(data_dir, tmp_path / "y", decode="device", **SMALL),
                        torch.device("cuda")).decode == "device"


@pytest.mark.slow
def test_auto_on_the_cpu_writes_the_features_of_decode_fast(data_dir, tmp_path):
    auto = precompute_features(FeatureConfig(data_dir, tmp_path / "auto", decode="auto", device="cpu", workers=0,
                                             **SMALL))
    fast = precompute_features(FeatureConfig(data_dir, tmp_path / "fast", decode="fast", device="cpu", workers=0,
                                             **SMALL))
    assert auto.config["decode"] == "fast" and auto.config_hash == fast.config_hash
    for a, f in zip(auto.splits["train"].shards, fast.splits["train"].shards):
        mine, theirs = load_feature_shard(tmp_path / "auto" / a.path), load_feature_shard(tmp_path / "fast" / f.path)
        assert mine.keys == theirs.keys and torch.equal(mine.features, theirs.features)


@pytest.mark.slow
def test_the_measured_split_feeds_each_row_from_one_path_and_records_its_shares(data_dir, tmp_path, monkeypatch):
    """The accelerator's code path, run on the CPU (``decode_jpeg:cpu`` as the device): the workers read the share
    the consumer sets from its measurements, each image goes to one side, and the summary keeps the shares."""
    from preprocess.features import decode_share, featurize
    from preprocess.features.featurize import run_precompute

    monkeypatch.setattr(featurize, "resolve_auto", lambda cfg, device: cfg)  # as on a GPU: auto stays auto
    monkeypatch.setattr(decode_share, "DEFAULT_CONTROL", ShareControl(every=1, hysteresis=0.0, grid=4, start=0.5))
    small = {**SMALL, "batch_size": 2}
    manifest, summary = run_precompute(FeatureConfig(data_dir, tmp_path / "auto", decode="auto", device="cpu",
                                                     workers=2, **small))
    device_only = precompute_features(FeatureConfig(data_dir, tmp_path / "device", decode="device", device="cpu",
                                                    workers=0, **small))
    fast_only = precompute_features(FeatureConfig(data_dir, tmp_path / "fast", decode="fast", device="cpu",
                                                  workers=0, **small))
    assert manifest.config["decode"] == "decode_jpeg:cpu@auto+fast"
    assert manifest.config_hash not in (device_only.config_hash, fast_only.config_hash)
    split = summary["decode_share"]
    assert split["batches"] == 5 and split["history"][0] == [0, 0.5] and set(split["costs_s"]) == {"cpu_s",
                                                                                                  "device_s"}
    assert all(0 < share < 1 for _, share in split["history"])

    def features(folder, made):
        out = {}
        for info in made.splits["train"].shards:
            shard = load_feature_shard(folder / info.path)
            out.update(zip(shard.keys, shard.features))
        return out

    rows = features(tmp_path / "auto", manifest)
    by_device, by_workers = features(tmp_path / "device", device_only), features(tmp_path / "fast", fast_only)
    assert rows.keys() == by_device.keys() == by_workers.keys()
    for key, row in rows.items():
        assert (torch.allclose(row, by_device[key], atol=1e-4, rtol=1e-4)
                or torch.allclose(row, by_workers[key], atol=1e-4, rtol=1e-4)), key
