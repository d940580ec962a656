"""Image models on CUDA train channels_last, model and batches alike; on the CPU, and for feature heads, the layout
is left as it was (issue 45, item 5)."""

import pytest
import torch

from shards.image.device import Normalize
from train.model.models import build_image_model, uses_channels_last


@pytest.mark.parametrize("device_type, data_kind, expected", [
    ("cuda", "images", True),
    ("cpu", "images", False),
    ("mps", "images", False),
    ("cuda", "features", False),
    ("cpu", "features", False),
])
def test_only_image_models_on_cuda_use_channels_last(device_type, data_kind, expected):
    assert uses_channels_last(device_type, data_kind) is expected


def test_the_rule_lays_out_the_model_and_the_normalised_batch_the_same_way():
    batch = torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8)
    for device_type, layout in (("cpu", torch.contiguous_format), ("cuda", torch.channels_last)):
        channels_last = uses_channels_last(device_type, "images")
        model = build_image_model("resnet18", 3).to(
            memory_format=torch.channels_last if channels_last else torch.preserve_format)  # as train.run.loop does
        inputs = Normalize(channels_last=channels_last)(batch)  # as train.data's normaliser does
        assert model.conv1.weight.is_contiguous(memory_format=layout)
        assert inputs.is_contiguous(memory_format=layout)
        assert inputs.dtype == torch.float32
        if device_type == "cpu":
            assert not model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
            assert not inputs.is_contiguous(memory_format=torch.channels_last)
