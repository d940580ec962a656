"""PyTorch Lightning 2.x: ``make_loader`` as a ``train_dataloader`` unchanged, single process and 2-process DDP (gloo,
CPU), and a mid-epoch resume through Lightning's own checkpoint yields exactly the batches the epoch had left."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import shards
from shards.loader.base import Loader
from tests.helpers import make_shard_dataset
from tests.integrations.ranks import run_ranks
from tests.shards.stream_helpers import write_feature_dataset

PARTS = Path(__file__).with_name("lightning_parts.py")
DOCS = Path(__file__).parents[2] / "docs" / "integrations.md"

SAMPLES = 40
EPOCH_KEYS = [f"train_{i:05d}" for i in range(SAMPLES)]
CHECKPOINT_STEP = 5


def _parts():
    """The Lightning pieces, imported when a test needs them (skipped without the ``integrations`` extra)."""
    pytest.importorskip("pytorch_lightning", reason="pip install 'shardcache[integrations]'")
    from tests.integrations import lightning_parts

    return lightning_parts


def _data(folder: Path, batch_size: int):
    data_module = _parts().ShardDataModule
    if (folder / "features.json").exists():  # the in-process feature loader: no workers, no transform
        return data_module(str(folder), batch_size, return_keys=True, seed=7, sampling=shards.Sampling(shuffle=True))
    return data_module(str(folder), batch_size, num_workers=2, transform="eval", return_keys=True, seed=7,
                       sampling=shards.Sampling(shuffle=True, shuffle_buffer=8))


def _fit(folder: Path, checkpoints: Path, batch_size: int, resume: Path | None = None, epochs: int = 1,
         **trainer_options):
    """``epochs`` epochs; checkpoints every ``CHECKPOINT_STEP`` steps unless resuming. Returns (batches' keys,
    trainer)."""
    parts = _parts()
    pl = parts.pl
    model = parts.KeyRecorder()
    callbacks = [] if resume else [pl.callbacks.ModelCheckpoint(dirpath=checkpoints, save_top_k=-1,
                                                                every_n_train_steps=CHECKPOINT_STEP)]
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=not resume, callbacks=callbacks,
                         **trainer_options)
    trainer.fit(model, datamodule=_data(folder, batch_size), ckpt_path=resume)
    return model.batches, trainer


def _checkpoint(checkpoints: Path) -> Path:
    path = checkpoints / f"epoch=0-step={CHECKPOINT_STEP}.ckpt"
    saved = torch.load(path, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert [state["batches"] for state in saved] == [CHECKPOINT_STEP]  # Lightning saved the loader's position
    return path


def _flat(batches: list[list[str]]) -> list[str]:
    return [key for batch in batches for key in batch]


@pytest.fixture
def folder(tmp_path) -> Path:
    make_shard_dataset(tmp_path / "data", shard_sizes={"train": [13, 11, 16]}, size=(16, 16))
    return tmp_path / "data"


def test_the_docs_example_is_the_one_tested():
    source = PARTS.read_text()
    example = next(node for node in ast.parse(source).body
                   if isinstance(node, ast.ClassDef) and node.name == "ShardDataModule")
    assert ast.get_source_segment(source, example) in DOCS.read_text()


@pytest.mark.slow
def test_single_process_fit_resumes_mid_epoch_from_lightnings_checkpoint(folder, tmp_path):
    full, trainer = _fit(folder, tmp_path / "ckpt", batch_size=4)
    assert isinstance(trainer.train_dataloader, Loader)  # taken as it is: no sampler, no wrapper
    assert sorted(_flat(full)) == EPOCH_KEYS
    resumed, _ = _fit(folder, tmp_path / "ckpt", batch_size=4, resume=_checkpoint(tmp_path / "ckpt"))
    assert _flat(full[:CHECKPOINT_STEP]) + _flat(resumed) == _flat(full)  # the rest, in order, nothing twice


@pytest.mark.slow
def test_feature_loader_resumes_mid_epoch_the_same_way(tmp_path):
    write_feature_dataset(tmp_path / "features", [17, 23])
    full, trainer = _fit(tmp_path / "features", tmp_path / "ckpt", batch_size=4)
    assert repr(trainer.train_dataloader.mode) == "InProcess()"
    assert sorted(_flat(full)) == [f"f{i:05d}" for i in range(SAMPLES)]
    resumed, _ = _fit(tmp_path / "features", tmp_path / "ckpt", batch_size=4, resume=_checkpoint(tmp_path / "ckpt"))
    assert _flat(full[:CHECKPOINT_STEP]) + _flat(resumed) == _flat(full)


@pytest.mark.slow
def test_each_epoch_gets_its_own_order_and_resumes_across_the_epoch_end(tmp_path):
    """Lightning sets the epoch through ``loader.sampler``: epoch 1 is served in epoch 1's order, as
    ``loader.set_epoch(1)`` gives it outside Lightning, not epoch 0's again; a checkpoint at the last step of epoch 0
    resumes with the whole of epoch 1, one in epoch 1 with the rest of it."""
    data = tmp_path / "features"
    write_feature_dataset(data, [17, 23])
    batches, _ = _fit(data, tmp_path / "ckpt", batch_size=4, epochs=2)  # checkpoints at steps 5, 10, 15, 20
    epochs = [_flat(batches[:10]), _flat(batches[10:])]
    loader = _data(data, 4).train_dataloader()
    for epoch, served in enumerate(epochs):
        loader.set_epoch(epoch)
        assert served == [key for _, _, keys in loader for key in keys]
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]
    for step, name in ((10, "epoch=0-step=10.ckpt"), (15, "epoch=1-step=15.ckpt")):
        resumed, _ = _fit(data, tmp_path / "ckpt", batch_size=4, epochs=2, resume=tmp_path / "ckpt" / name)
        assert resumed == batches[step:]


def _ddp_rank(rank: int, world: int, folder: str, checkpoints: str, out: str) -> None:
    options = dict(strategy="ddp", devices=world, num_nodes=1)  # processes started outside, torchrun-style
    full, trainer = _fit(Path(folder), Path(checkpoints), 2, **options)
    loader = trainer.train_dataloader
    assert isinstance(loader, Loader) and loader.dataset.config.world_size == world  # not re-sampled by Lightning
    trainer.strategy.barrier()  # rank 0 wrote the checkpoint
    resumed, _ = _fit(Path(folder), Path(checkpoints), 2, resume=_checkpoint(Path(checkpoints)), **options)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"full": full, "resumed": resumed}))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_process_ddp_fit_splits_the_epoch_and_resumes_mid_epoch(folder, tmp_path):
    run_ranks(_ddp_rank, 2, str(folder), str(tmp_path / "ckpt"), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert sorted(_flat(ranks[0]["full"]) + _flat(ranks[1]["full"])) == EPOCH_KEYS  # split, not duplicated
    for rank in ranks:
        assert len(rank["full"]) == SAMPLES // 2 // 2
        assert _flat(rank["full"][:CHECKPOINT_STEP]) + _flat(rank["resumed"]) == _flat(rank["full"])
