"""The backbone registry: penultimate widths per family, weights that never download, one-line errors."""

from __future__ import annotations

import pytest
import torch
import torchvision

from preprocess.features import backbones
from preprocess.features.backbones import build_backbone, build_model
from shards.atomic import sha256_file
from shards.errors import InputError, MissingInputError

PENULTIMATE = [
    ("resnet18", 512),
    ("resnet50", 2048),
    ("efficientnet_b0", 1280),
    ("vit_b_16", 768),
    ("convnext_tiny", 768),
    ("regnet_y_400mf", 440),
    # The input of mobilenet_v3's final Linear is its 1024-wide hidden layer (576 is the pooled conv output).
    ("mobilenet_v3_small", 1024),
    ("mobilenet_v2", 1280),
]




@pytest.mark.parametrize("name,dim", PENULTIMATE)
@pytest.mark.slow
def test_penultimate_width_per_family(name, dim):
    backbone = build_backbone(name, "none")
    assert backbone.features_dim == dim
    if backbone.input_size is None:
        with torch.inference_mode():
            assert backbone.model(torch.rand(1, 3, 32, 32)).shape == (1, dim)
    else:  # vit takes 224px only: too slow a forward for the suite, check the cut structurally
        assert backbone.input_size == 224
        assert backbone.model.hidden_dim == dim and not any(isinstance(m, torch.nn.Linear)
                                                            for m in backbone.model.heads.modules())
    assert not backbone.model.training
    assert not any(p.requires_grad for p in backbone.model.parameters())


def test_features_are_the_input_of_the_final_linear():
    headless, _ = build_model("mobilenet_v3_small", "none", seed=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same init as build_model's seed 0
        full = torchvision.models.get_model("mobilenet_v3_small", weights=None).eval()
    seen = {}
    full.classifier[-1].register_forward_hook(lambda mod, inp, out: seen.__setitem__("x", inp[0]))
    image = torch.rand(2, 3, 32, 32)
    with torch.inference_mode():
        full(image)
        assert torch.allclose(headless(image), seen["x"], atol=1e-6)


@pytest.mark.slow  # over half a second in the quick loop
def test_random_init_is_a_function_of_the_seed():
    first = build_backbone("resnet18", "none", seed=3).model.state_dict()
    again = build_backbone("resnet18", "none", seed=3).model.state_dict()
    other = build_backbone("resnet18", "none", seed=4).model.state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["conv1.weight"], other["conv1.weight"])


def test_unknown_and_unsupported_backbones_are_input_errors():
    with pytest.raises(InputError, match="unknown backbone 'resnet19'"):
        build_backbone("resnet19")
    with pytest.raises(InputError, match="not supported"):
        build_backbone("squeezenet1_0")


def _saved_resnet18(path, *, wrap=None, prefix=""):
    torch.manual_seed(7)
    model = torchvision.models.resnet18(weights=None).eval()
    state = {prefix + k: v for k, v in model.state_dict().items()}
    torch.save({wrap: state} if wrap else state, path)
    return model


@pytest.mark.parametrize("wrap,prefix", [pytest.param(None, "", marks=pytest.mark.slow), pytest.param("state_dict", "", marks=pytest.mark.slow),
                                         pytest.param("model", "module.", marks=pytest.mark.slow)])
def test_local_weights_file_is_loaded_strictly(tmp_path, wrap, prefix):
    path = tmp_path / "r18.pt"
    model = _saved_resnet18(path, wrap=wrap, prefix=prefix)
    backbone = build_backbone("resnet18", str(path))
    assert backbone.weights_sha256 == sha256_file(path)
    assert backbone.init_seed is None
    model.fc = torch.nn.Identity()
    image = torch.rand(2, 3, 32, 32)
    with torch.inference_mode():
        assert torch.equal(backbone.model(image), model(image))


def test_weights_of_another_architecture_name_the_file(tmp_path):
    path = tmp_path / "squeezenet.pth"  # another architecture, and one that is quick to build
    torch.save(torchvision.models.squeezenet1_1(weights=None).state_dict(), path)
    with pytest.raises(InputError) as info:
        build_backbone("resnet18", str(path))
    message = str(info.value)
    assert str(path) in message and "do not fit resnet18" in message and "\n" not in message


def test_corrupt_weights_file_is_an_input_error(tmp_path):
    path = tmp_path / "broken.pt"
    path.write_bytes(b"PK\x03\x04 this is not a checkpoint")
    with pytest.raises(InputError, match="not a readable weights file") as info:
        build_backbone("resnet18", str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_weights_file(tmp_path):
    with pytest.raises(MissingInputError):
        build_backbone("resnet18", str(tmp_path / "absent.pt"))


@pytest.fixture()
def hub_dir(tmp_path):
    previous = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "hub"))
    yield tmp_path / "hub"
    torch.hub.set_dir(previous)


def test_weights_name_never_downloads(hub_dir):
    with pytest.raises(InputError, match="never downloads") as info:
        build_backbone("mobilenet_v2", "IMAGENET1K_V2")
    assert "mobilenet_v2-7ebf99e0.pth" in str(info.value) and "--weights" in str(info.value)
    assert not (hub_dir / "checkpoints").exists()


def test_weights_name_from_the_local_cache_brings_its_eval_preset(hub_dir):
    target = hub_dir / "checkpoints" / "mobilenet_v2-7ebf99e0.pth"
    target.parent.mkdir(parents=True)
    torch.save(torchvision.models.mobilenet_v2(weights=None).state_dict(), target)
    backbone = build_backbone("mobilenet_v2", "IMAGENET1K_V2")
    assert backbone.weights_sha256 == sha256_file(target)
    assert backbone.weights == "MobileNet_V2_Weights.IMAGENET1K_V2"
    assert backbone.eval_preset == {"resize": 232, "crop": 224, "mean": [0.485, 0.456, 0.406],
                                    "std": [0.229, 0.224, 0.225], "interpolation": "bilinear"}
    with pytest.raises(InputError, match="not a file and not a weights name"):
        build_backbone("mobilenet_v2", "IMAGENET9K")


def test_local_file_named_by_its_hash_gets_the_torchvision_preset(tmp_path, monkeypatch):
    path = tmp_path / "renamed.pth"
    torch.save(torchvision.models.mobilenet_v2(weights=None).state_dict(), path)
    # A file whose sha256 starts like torchvision's published name mobilenet_v2-b0353104.pth (IMAGENET1K_V1).
    monkeypatch.setattr(backbones, "sha256_file", lambda p: "b0353104" + "0" * 56)
    backbone = build_backbone("mobilenet_v2", str(path))
    assert backbone.eval_preset["resize"] == 256 and backbone.eval_preset["crop"] == 224
