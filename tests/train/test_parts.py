"""The training loop's parts on their own: schedule, metrics, data-wait meter, checkpoints, prefetch, plot, config."""

from __future__ import annotations

import math
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from shards.errors import CorruptDataError, InputError
from train.run.checkpoint import capture_rng_state, load_checkpoint, restore_rng_state, save_checkpoint
from tests.train.configs import train_config
from train.config import TrainConfig
from train.run.diagnose import wait_advice
from train.run.task import class_weights
from train.run.meter import DataWaitMeter
from train.model.metrics import ClassificationTally
from train.model.models import build_head
from train.model.optim import build_optimizer, build_scheduler, warmup_cosine
from train.run.plot import plot_curves
from train.prefetch import ThreadPrefetcher


def test_warmup_then_cosine_to_zero():
    factor = warmup_cosine(total_steps=100, warmup_steps=10)
    assert [factor(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert factor(10) == pytest.approx(1.0)
    assert factor(55) == pytest.approx(0.5)
    assert factor(100) == pytest.approx(0.0, abs=1e-12)
    assert all(factor(s) >= factor(s + 1) for s in range(10, 100))


def test_scheduler_state_restores_the_same_rates(tmp_path: Path):
    cfg = train_config("x", "y", epochs=4, lr=0.2, warmup_epochs=1)
    model = build_head("linear", 4, 3)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer, steps_per_epoch=5)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    torch.save(scheduler.state_dict(), tmp_path / "scheduler.pt")
    saved = torch.load(tmp_path / "scheduler.pt", weights_only=True)  # plain numbers only
    fresh_optimizer = build_optimizer(cfg, build_head("linear", 4, 3))
    fresh = build_scheduler(cfg, fresh_optimizer, steps_per_epoch=5)
    fresh.load_state_dict(saved)
    assert fresh.get_last_lr() == scheduler.get_last_lr()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.2 * 0.5 * (1 + math.cos(math.pi * 2 / 15)))


def test_weight_decay_skips_biases():
    cfg = train_config("x", "y", weight_decay=0.5)
    groups = build_optimizer(cfg, build_head("mlp", 4, 3, hidden_dim=8)).param_groups
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    assert all(p.ndim == 1 for p in groups[1]["params"])


def test_tally_counts_top1_top5_per_class_and_confusion():
    tally = ClassificationTally(6)
    logits = torch.tensor([[9, 8, 7, 6, 5, 0], [0, 9, 1, 1, 1, 1], [9, 0, 0, 0, 0, 8.0]])
    labels = torch.tensor([0, 2, 5])
    tally.update(logits, labels, torch.tensor(3.0))
    result = tally.result(["a", "b", "c", "d", "e", "f"])
    assert result["val_top1"] == pytest.approx(1 / 3)
    assert result["val_top5"] == pytest.approx(1.0)  # label 2 is 2nd best, label 5 2nd best
    assert result["val_loss"] == pytest.approx(1.0)
    assert result["val_per_class_accuracy"]["a"] == 1.0 and result["val_per_class_accuracy"]["c"] == 0.0
    assert result["val_per_class_accuracy"]["b"] is None  # no samples of class b
    assert result["val_confusion"][2][1] == 1 and result["val_confusion"][5][0] == 1


def test_no_top5_with_five_classes_or_fewer():
    tally = ClassificationTally(5)
    tally.update(torch.eye(5), torch.arange(5), torch.tensor(0.0))
    assert "val_top5" not in tally.result(list("abcde"))


def test_meter_counts_time_blocked_in_next():
    """A fake clock: each batch takes 2 s to arrive and the loop works 3 s on it, so 6 of 15 s are waiting."""
    now = [0.0]
    meter = DataWaitMeter(clock=lambda: now[0])

    def batches():
        for i in range(3):
            now[0] += 2.0  # the loader blocks
            yield torch.zeros(1) + i

    meter.start()
    consumed = []
    for batch in meter.iterate(batches()):
        consumed.append(batch)
        now[0] += 3.0  # the training step
    meter.stop()
    assert len(consumed) == 3 and meter.batches == 3
    assert meter.wait_s == 6.0 and meter.wall_s == 15.0
    assert meter.wait_share == pytest.approx(0.4)


def test_wait_advice_only_above_twenty_percent_and_two_seconds():
    assert wait_advice(0.1, 30.0, data_kind="images", workers=2) is None
    assert wait_advice(0.9, 1.5, data_kind="images", workers=2) is None  # most of a short epoch, but 1.5 s in all
    advice = wait_advice(0.45, 9.0, data_kind="images", workers=2)
    assert "45%" in advice and "9.0 s" in advice and "--workers" in advice and "features" in advice
    assert "decode" in advice
    assert "local disk" not in advice and "--cache-dir" not in advice  # local shards: a copy or a cache cannot help
    remote = wait_advice(0.45, 9.0, data_kind="images", workers=2, network_reads=True)
    assert "--cache-dir" in remote and "local disk" in remote


def test_class_weights_are_inverse_frequency():
    weights = class_weights([30, 10, 0])
    assert weights.tolist() == pytest.approx([40 / 60, 40 / 20, 0.0])


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path: Path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    save_checkpoint(tmp_path / "c.pt", {"rng": capture_rng_state()})
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9)
    np.random.seed(9)
    random.seed(9)
    restore_rng_state(load_checkpoint(tmp_path / "c.pt")["rng"])
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]
    assert not list(tmp_path.glob("*.tmp"))


def test_foreign_or_truncated_checkpoint_is_refused(tmp_path: Path):
    torch.save({"model": 1}, tmp_path / "other.pt")
    with pytest.raises(CorruptDataError, match="not a shardcache checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CorruptDataError, match="unreadable"):
        load_checkpoint(tmp_path / "cut.pt")


def test_prefetcher_keeps_order_and_passes_errors_on():
    batches = [(torch.full((2,), i), torch.tensor([i])) for i in range(7)]
    assert [int(b[1]) for b in ThreadPrefetcher(batches, depth=2)] == list(range(7))

    def failing():
        yield batches[0]
        raise CorruptDataError("bad shard", path="x.pt")

    with pytest.raises(CorruptDataError, match="bad shard"):
        list(ThreadPrefetcher(failing()))
    stream = iter(ThreadPrefetcher(batches, depth=1))
    assert int(next(stream)[1]) == 0
    assert any(t.name == "feature-prefetch" for t in threading.enumerate())
    stream.close()  # an early stop ends the thread instead of leaving it blocked on a full queue
    assert not any(t.name == "feature-prefetch" and t.is_alive() for t in threading.enumerate())


def test_plot_writes_a_png_even_for_one_epoch(tmp_path: Path):
    history = [{"epoch": 1, "train_loss": 1.0, "val_loss": 1.2, "train_top1": 0.5, "val_top1": 0.4}]
    path = plot_curves(history, tmp_path / "curves.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("changes, fragment", [
    ({"head": "transformer"}, "head='transformer'"),
    ({"optimizer": "lion"}, "optimizer"),
    ({"batch_size": 0}, "batch_size"),
    ({"resume": True, "overwrite": True}, "choose one"),
    ({"val_split": "train"}, "both 'train'"),
    ({"dropout": 1.0}, "dropout"),
])
def test_config_rejects_bad_values(changes, fragment):
    with pytest.raises(InputError, match=fragment):
        train_config("x", "y", **changes)


def test_config_differences_ignore_what_a_resume_may_change():
    base = train_config("x", "y")
    assert base.differences(base.replace({"optim.epochs": 20, "run.resume": True, "run.quiet": True})) == []
    assert base.differences(base.replace({"optim.lr": 0.3, "optim.seed": 1})) == ["optim.lr", "optim.seed"]
    assert TrainConfig.from_dict(base.to_dict()) == base


def test_decode_choices_and_validation_come_from_shards():
    from shards.stream.options import STREAM_DECODES

    assert train_config("data", "out").loader.decode == "fast"  # training owns the device-side normalisation
    assert all(train_config("data", "out", decode=name).loader.decode == name for name in STREAM_DECODES)
    with pytest.raises(InputError, match="decode='turbo' is not one of standard, fast"):
        train_config("data", "out", decode="turbo")
    with pytest.raises(InputError, match="not available in train-from-shards") as caught:
        train_config("data", "out", decode="device")  # only precompute-features decodes on the device
    assert "\n" not in str(caught.value)


def test_a_recorded_config_reads_as_its_run():
    recorded = TrainConfig.from_dict(train_config("data", "out", decode="standard").to_dict())
    assert recorded.loader.decode == "standard"
    assert recorded.differences(train_config("data", "out")) == ["loader.decode"]  # a resume with the other decode is refused


def test_fine_tune_weights_unwrap_a_checkpoint_of_a_ddp_model(tmp_path: Path):
    from train.model.models import load_matching_weights

    source = torch.nn.Linear(4, 3)
    torch.save({"model": {f"module.{k}": v for k, v in source.state_dict().items()}, "epoch": 1}, tmp_path / "w.pt")
    target = torch.nn.Linear(4, 3)
    load_matching_weights(target, tmp_path / "w.pt")
    assert torch.equal(target.weight, source.weight)
    torch.save({"model": torch.nn.Linear(4, 3)}, tmp_path / "pickled.pt")  # a whole module: never unpickled
    with pytest.raises(InputError, match="weights_only=True"):
        load_matching_weights(target, tmp_path / "pickled.pt")
