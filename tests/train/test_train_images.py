"""Training a torchvision model from image shards: it learns, fine-tunes from local weights, and dry-runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shards.errors import InputError
from tests.train.configs import train_config
from train.config import TrainConfig
from train.run.loop import train
from train.model.models import build_image_model
from shards.runrecord import read_rows


def config(data: Path, out: Path, **changes) -> TrainConfig:
    options = dict(name="resnet18", image_size=32, epochs=3, batch_size=8, optimizer="adamw",
                   lr=2e-3, workers=0, quiet=True, device="cpu")
    options.update(changes)
    return train_config(str(data), str(out), **options)


@pytest.mark.slow
def test_image_model_loss_falls(image_folder: Path, tmp_path: Path):
    summary = train(config(image_folder, tmp_path / "run"))
    rows = [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")]
    assert len(rows) == 3 and summary["steps"] == 18  # 48 samples, batches of 8
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    model = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert model["model"] == "resnet18" and model["transform"]["size"] == 32
    assert model["classes"] == ["red", "green", "blue"]


@pytest.mark.slow
def test_fine_tune_from_local_weights_with_another_class_count(image_folder: Path, tmp_path: Path):
    pretrained = build_image_model("resnet18", 10)
    weights = tmp_path / "resnet18-10.pt"
    torch.save(pretrained.state_dict(), weights)
    model = build_image_model("resnet18", 3, weights=weights)
    assert torch.equal(model.conv1.weight, pretrained.conv1.weight)
    assert model.fc.out_features == 3
    summary = train(config(image_folder, tmp_path / "run", epochs=1, weights=str(weights)))
    assert summary["steps"] == 6
    assert torch.load(tmp_path / "run" / "model.pt", weights_only=True)["state_dict"]["fc.weight"].shape == (3, 512)


def test_weights_of_another_architecture_are_refused(tmp_path: Path):
    weights = tmp_path / "mobilenet.pt"
    torch.save(build_image_model("mobilenet_v3_small", 3).state_dict(), weights)
    with pytest.raises(InputError, match="do not fit"):
        build_image_model("resnet18", 3, weights=weights)


@pytest.mark.parametrize("decode, loader_dtype", [("fast", "uint8"), ("standard", "float32")])
def test_dry_run_shows_normalised_image_batch(image_folder: Path, tmp_path: Path, decode: str, loader_dtype: str):
    report = train(config(image_folder, tmp_path / "run", dry_run=True, decode=decode))
    assert report["loader_dtype"] == loader_dtype  # the fast pipeline ships bytes and normalises on the device
    assert report["batch_shape"] == [8, 3, 32, 32]
    assert report["dtype"] == "float32"
    assert report["min"] < 0 < report["max"]  # ImageNet-normalised, not 0..255 bytes
    assert report["max"] < 5
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_image_run_killed_mid_epoch_resumes_bitwise_with_a_worker(image_folder: Path, tmp_path: Path):
    """Random crops and flips run in a DataLoader worker; the reader seeds them per sample, so they replay."""
    options = dict(name="mobilenet_v3_small", epochs=2, workers=1, checkpoint_every=4)
    train(config(image_folder, tmp_path / "whole", **options))
    stopped = train(config(image_folder, tmp_path / "resumed", stop_after_steps=5, **options))
    assert stopped["stopped"]
    train(config(image_folder, tmp_path / "resumed", resume=True, **options))
    expected = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)["state_dict"]
    actual = torch.load(tmp_path / "resumed" / "model.pt", weights_only=True)["state_dict"]
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


@pytest.mark.slow
def test_image_run_resumed_with_another_worker_count_finishes_the_epoch(image_folder: Path, tmp_path: Path):
    """Two workers, stopped after the checkpoint at step 4 of 6; one worker then trains on the 16 samples left."""
    options = dict(name="mobilenet_v3_small", epochs=2, checkpoint_every=4)
    assert train(config(image_folder, tmp_path / "run", stop_after_steps=5, workers=2, **options))["stopped"]
    resumed = train(config(image_folder, tmp_path / "run", resume=True, workers=1, **options))
    assert resumed["steps"] == 12 and not resumed["stopped"]  # 4 + 2 batches of the rest, then a whole epoch
    assert [row["epoch"] for row in [row.to_json() for row in read_rows(tmp_path / "run" / "metrics.jsonl")]] == [1, 2]


@pytest.mark.slow
def test_a_run_stops_its_loader_workers_when_it_returns(image_folder: Path, tmp_path: Path):
    """The run's loaders sit in a reference cycle (the watchdog calls back into the run): left to the cyclic
    collector, torch's index queues could be finalised first and every worker waited out 5 s before being
    killed. The run closes them itself, so no worker outlives ``train`` and nothing waits at collection."""
    import gc
    import multiprocessing
    import time

    gc.collect()
    gc.disable()  # what the run leaves to the collector is not collected before the check
    try:
        train(config(image_folder, tmp_path / "run", epochs=1, workers=2, name="mobilenet_v2"))
        assert multiprocessing.active_children() == []
    finally:
        gc.enable()
    started = time.monotonic()
    gc.collect()
    assert time.monotonic() - started < 4
