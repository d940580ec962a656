"""resolve_device: one reading of --device for every job; torchrun's local rank picks the GPU."""

from __future__ import annotations

import pytest
import torch

from shards.devices import resolve_device
from shards.errors import InputError


def test_cpu_and_auto_without_cuda():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cpu", local_rank=3) == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        assert resolve_device("auto", local_rank=1) == torch.device("cpu")


def test_a_malformed_name_is_one_line_naming_the_device():
    with pytest.raises(InputError, match="'gpu0'") as info:
        resolve_device("gpu0")
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused():
    for name in ("cuda", "cuda:1"):
        with pytest.raises(InputError, match="CUDA is not available"):
            resolve_device(name, local_rank=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_local_rank_picks_the_gpu_unless_an_index_is_given():
    count = torch.cuda.device_count()
    assert resolve_device("auto", local_rank=count + 1) == torch.device("cuda", (count + 1) % count)
    assert resolve_device("cuda", local_rank=0) == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cuda:0", local_rank=5) == torch.device("cuda", 0)
