"""``dataset.normalizer()``: every dataset says how its batches become the model's input, so a consumer never asks
which pipeline made them. The identity where samples come ready, the fast decoder's ``Normalize`` where they come
as uint8."""

from __future__ import annotations

from pathlib import Path

import torch

import shards
from shards.image.fast import Normalize
from shards.loader.in_process import InProcess
from tests.helpers import make_shard_dataset
from tests.shards.stream_helpers import write_feature_dataset

ORDERED = shards.Sampling(shuffle=False)


def first_batch(dataset, size: int = 4) -> torch.Tensor:
    return next(iter(shards.make_loader(dataset, batch_size=size, mode=InProcess(), drop_last=False)))[0]


def test_feature_rows_come_ready_so_the_normalizer_passes_them_on(tmp_path: Path):
    write_feature_dataset(tmp_path / "features", [6, 5])
    dataset = shards.open_dataset(tmp_path / "features", "train", sampling=ORDERED)
    batch = first_batch(dataset)
    normalize = dataset.normalizer(channels_last=True).to("cpu")  # a module, movable like the fast one
    assert isinstance(normalize, torch.nn.Module)
    assert normalize(batch) is batch


def test_the_standard_pipeline_normalises_in_the_workers_so_the_normalizer_passes_batches_on(tmp_path: Path):
    make_shard_dataset(tmp_path / "data", size=(40, 30))
    dataset = shards.open_dataset(tmp_path / "data", "val", transform=shards.TransformSpec(preset="eval", size=32),
                                  sampling=ORDERED)
    batch = first_batch(dataset)
    assert batch.dtype == torch.float32 and batch.min() < 0  # already normalised
    assert dataset.normalizer()(batch) is batch


def test_a_custom_decoder_without_a_normaliser_gets_the_identity(tmp_path: Path):
    make_shard_dataset(tmp_path / "data", size=(16, 16))
    dataset = shards.open_dataset(tmp_path / "data", "val",
                                  decode=shards.Decode(decoder=lambda sample, seed: torch.zeros(2)))
    batch = first_batch(dataset)
    assert dataset.normalizer()(batch) is batch


def test_the_fast_pipeline_normalises_uint8_batches_as_its_decoders_normalize_did(tmp_path: Path):
    make_shard_dataset(tmp_path / "data", size=(60, 44))
    spec = shards.TransformSpec(preset="eval", size=32, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))
    fast = shards.open_dataset(tmp_path / "data", "val", transform=spec, decode=shards.Decode("fast"),
                               sampling=ORDERED)
    batch = first_batch(fast)
    assert batch.dtype == torch.uint8
    out = fast.normalizer()(batch)
    assert out.dtype == torch.float32
    assert torch.equal(out, Normalize(spec.mean, spec.std)(batch))  # the spec's own mean and std, bit for bit
    mean, std = torch.tensor(spec.mean).view(1, 3, 1, 1), torch.tensor(spec.std).view(1, 3, 1, 1)
    assert torch.allclose(out, (batch.float() / 255 - mean) / std, atol=1e-5)
    # The options shape the model's input layout, as on the decoder's own normaliser.
    assert fast.normalizer(dtype=torch.bfloat16)(batch).dtype == torch.bfloat16
    assert fast.normalizer(channels_last=True)(batch).is_contiguous(memory_format=torch.channels_last)


def test_a_mixture_of_image_sources_normalises_like_one_source(tmp_path: Path):
    for name in ("p", "q"):
        make_shard_dataset(tmp_path / name, size=(40, 40))
    spec = shards.TransformSpec(preset="eval", size=24)
    mixed = shards.open_dataset([tmp_path / "p", tmp_path / "q"], "val", transform=spec,
                                decode=shards.Decode("fast"), sampling=ORDERED)
    batch = first_batch(mixed)
    assert torch.equal(mixed.normalizer()(batch), Normalize(spec.mean, spec.std)(batch))
