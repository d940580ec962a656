"""``train-from-shards --stall-timeout``: a worker that dies on one sample is restarted, the sample quarantined
after its second death, and the run folder says so (data events, stack dumps, ``quarantined`` per epoch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shards.stream.image_dataset import ImageShardDataset
from tests.train.configs import train_config
from shards.data_events import read_events
from train.run.loop import train
from shards.runrecord import read_rows

BAD_KEY = "train_00005"


@pytest.fixture
def deadly_sample(monkeypatch):
    """A decoder that ends its worker process on ``BAD_KEY`` (forked DataLoader workers inherit it)."""
    decode_row = ImageShardDataset.decode_row

    def exit_on_bad_key(self, sample, seed, row):
        if sample.key == BAD_KEY:
            os._exit(1)
        return decode_row(self, sample, seed, row)

    monkeypatch.setattr(ImageShardDataset, "decode_row", exit_on_bad_key)


@pytest.mark.slow
def test_a_sample_that_kills_its_worker_is_quarantined_and_recorded(image_folder: Path, tmp_path: Path,
                                                                     deadly_sample):
    out = tmp_path / "run"
    cfg = train_config(str(image_folder), str(out), name="resnet18", image_size=32,
                      epochs=2, batch_size=8, optimizer="adamw", workers=2, quiet=True, device="cpu",
                      stall_timeout=30, report=False)
    summary = train(cfg)
    assert summary["steps"] == 12  # 48 samples, batches of 8: the stand-in keeps the epoch's length
    assert [row["quarantined"] for row in [row.to_json() for row in read_rows(out / "metrics.jsonl")]] == [1, 1]
    events = [e for e in read_events(out) if e["kind"] in ("restart", "quarantine")]
    assert [(e["kind"], e["reason"], e["epoch"], e["rank"]) for e in events] == [
        ("restart", "exit 1", 1, 0), ("restart", "exit 1", 1, 0), ("quarantine", "exit 1", 1, 0)]
    assert events[2]["key"] == BAD_KEY and 1 <= events[2]["step"] <= 6
    assert all((out / e["stacks"]).is_file() for e in events[:2])
