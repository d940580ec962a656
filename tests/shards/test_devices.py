"""resolve_device: one reading of --device for every job; torchrun's local rank picks the GPU."""

from __future__ import annotations

import pytest
import torch

from shards.jobs.devices import resolve_device
from shards.errors import InputError


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def four_gpus(monkeypatch):
    """The choice is pure arithmetic over what torch reports, so a pretended node of 4 GPUs tests it anywhere."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)


def test_cpu_and_auto_without_cuda(no_cuda):
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("auto", local_rank=1) == torch.device("cpu")


def test_a_malformed_name_is_one_line_naming_the_device():
    with pytest.raises(InputError, match="'gpu0'") as info:
        resolve_device("gpu0")
    assert "\n" not in str(info.value)


def test_cuda_without_cuda_is_refused(no_cuda):
    for name in ("cuda", "cuda:1"):
        with pytest.raises(InputError, match="CUDA is not available"):
            resolve_device(name, local_rank=0)


def test_local_rank_picks_the_gpu_unless_an_index_is_given(four_gpus):
    assert resolve_device("auto", local_rank=5) == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:0", local_rank=5) == torch.device("cuda", 0)
