"""The Lightning pieces the tests of ``test_lightning.py`` train with, kept apart so that collecting the tests does
not import Lightning (seconds): the DataModule of docs/integrations.md, as written there, and a model that records
which samples it trained on."""

from __future__ import annotations

import pytorch_lightning as pl
import torch

import shards


# -- the example of docs/integrations.md, as written there -----------------------------------------------------------
class ShardDataModule(pl.LightningDataModule):
    """Training batches of a shardcache dataset; Lightning saves and restores the loader's position."""

    def __init__(self, folder: str, batch_size: int = 256, num_workers: int | None = None, **dataset_options):
        super().__init__()
        self.folder, self.batch_size, self.num_workers = folder, batch_size, num_workers
        self.dataset_options = dataset_options

    def train_dataloader(self):
        # Made here, once Lightning has started the process group: open_dataset reads rank and world size from it.
        dataset = shards.open_dataset(self.folder, "train", **self.dataset_options)
        mode = None if self.num_workers is None else (
            shards.WorkerProcesses(self.num_workers) if self.num_workers else shards.InProcess())
        return shards.make_loader(dataset, self.batch_size, mode=mode)  # None: the dataset kind's default
# ---------------------------------------------------------------------------------------------------------------------


class KeyRecorder(pl.LightningModule):
    """A one-weight model that records the keys of every batch it trains on."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Linear(1, 1)
        self.batches: list[list[str]] = []

    def training_step(self, batch, batch_idx):
        _, labels, keys = batch
        self.batches.append(list(keys))
        return self.weight(labels.float()[:, None]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
