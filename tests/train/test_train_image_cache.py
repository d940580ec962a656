"""``train-from-shards --cache-images [--memory-limit]``: both image loaders cache, within one budget per process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shards.errors import InputError
from tests.train.configs import train_config
from train.config import TrainConfig
from train.data import build_data, prepare_manifest
from train.distributed import DistContext
from tests.train.test_cli import assert_one_line_error, run_cli


def config(data: Path, out: Path, **changes) -> TrainConfig:
    options = dict(name="resnet18", image_size=32, epochs=1, batch_size=8, workers=0, quiet=True,
                   device="cpu", images=True)
    options.update(changes)
    return train_config(str(data), str(out), **options)


def cpu_context(world: int = 1, local: int = 1) -> DistContext:
    return DistContext(0, world, 0, torch.device("cpu"), False, local)


def test_both_loaders_cache_within_the_memory_limit(image_folder: Path, tmp_path: Path):
    cfg = config(image_folder, tmp_path / "run", memory_limit=1 << 20)
    data = build_data(cfg, prepare_manifest(cfg), cpu_context())
    train_cache, val_cache = data.train_loader.dataset.image_cache, data.val_loader.dataset.image_cache
    assert train_cache.decoder.spec.preset == "train" and train_cache.decoder.source_side == 37  # 32 / 0.875
    assert val_cache.limit == 12 * 3 * 32 * 32  # the val crops' exact need
    assert train_cache.limit + val_cache.limit == 1 << 20
    batch = next(iter(data.train_loader))
    assert batch[0].dtype == torch.uint8 and batch[0].shape == (8, 3, 32, 32)


def test_without_the_flag_nothing_is_cached(image_folder: Path, tmp_path: Path):
    cfg = config(image_folder, tmp_path / "run", images=False)
    data = build_data(cfg, prepare_manifest(cfg), cpu_context())
    assert data.train_loader.dataset.image_cache is None and data.val_loader.dataset.image_cache is None


def test_switching_the_cache_is_another_run_and_the_limit_is_not():
    cfg = train_config("d", "o", images=True)
    assert cfg.differences(cfg.replace({"cache.images": False})) == ["cache.images"]  # train views change source
    assert cfg.differences(cfg.replace({"cache.memory_limit": 1 << 30})) == []


def test_bad_combinations_are_refused():
    with pytest.raises(InputError, match=r"give cache\.images too"):
        train_config("d", "o", memory_limit=1 << 30)
    with pytest.raises(InputError, match=r"cache\.images needs loader\.decode='fast'"):
        train_config("d", "o", images=True, decode="standard")


def test_the_cli_takes_the_options(image_folder: Path, tmp_path: Path):
    result = run_cli(image_folder, "--out", tmp_path / "run", "--image-size", "32", "--batch-size", "8",
                     "--workers", "0", "--cache-images", "--memory-limit", "8M", "--dry-run")
    assert result.exit_code == 0, result.output
    bad = run_cli(image_folder, "--out", tmp_path / "run", "--memory-limit", "8M")
    assert_one_line_error(bad, "cache.memory_limit", "cache.images")
