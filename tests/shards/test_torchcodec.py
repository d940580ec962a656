"""Batched JPEG decoding with torchcodec where it is usable, torchvision's decoders otherwise: pixel for pixel the
current path's output (PIL, libjpeg-turbo), the same typed error on damaged bytes, and a torchcodec that is absent or
does not load against this torch falls back without a word to the user."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from shards.errors import CorruptDataError, InputError
from shards.image.decode import decode_image
from shards.image.device import JPEG_BACKENDS, decode_images, exif_orientation, jpeg_backend

ROOT = Path(__file__).resolve().parents[2]
torchcodec_usable = jpeg_backend() == "torchcodec"
needs_torchcodec = pytest.mark.skipif(not torchcodec_usable, reason="torchcodec is not installed or does not load")
BACKENDS = [pytest.param("torchcodec", marks=needs_torchcodec), "torchvision"]


def _photo(width: int = 53, height: int = 37, seed: int = 0) -> Image.Image:
    """Smooth colour plus grain: every DCT frequency is used, so IDCT and upsampling differences would show."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)).resize((width, height),
                                                                                      Image.Resampling.BICUBIC)
    pixels = np.clip(np.asarray(coarse, dtype=np.int16) + rng.integers(-30, 31, (height, width, 3)), 0, 255)
    return Image.fromarray(pixels.astype(np.uint8))


def _jpeg(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", **options)
    return buffer.getvalue()


def _rotated(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _jpeg(_photo(31, 18, seed=orientation), quality=92, exif=exif)


JPEGS = {
    "rgb-420": _jpeg(_photo(), quality=90),
    "rgb-444": _jpeg(_photo(), quality=95, subsampling=0),
    "rgb-422": _jpeg(_photo(), quality=75, subsampling=1),
    "odd-size": _jpeg(_photo(17, 23, seed=1), quality=60),
    "low-quality": _jpeg(_photo(seed=2), quality=5),
    "grayscale": _jpeg(_photo(seed=3).convert("L"), quality=90),
    "cmyk": _jpeg(_photo(seed=4).convert("CMYK"), quality=90),
    "progressive": _jpeg(_photo(64, 48, seed=5), quality=85, progressive=True),
    "progressive-gray": _jpeg(_photo(seed=6).convert("L"), quality=85, progressive=True),
    "optimized": _jpeg(_photo(seed=7), quality=90, optimize=True),
    **{f"exif-orientation-{o}": _rotated(o) for o in range(1, 9)},
}


def _current(data: bytes) -> torch.Tensor:
    """What the current path gives: PIL's upright RGB pixels as uint8 [3, H, W]."""
    return torch.from_numpy(np.asarray(decode_image(data)).copy()).permute(2, 0, 1)


def _decode(datas: list[bytes], backend: str, keys: list[str] | None = None) -> list[torch.Tensor]:
    return decode_images(datas, ["jpg"] * len(datas), [exif_orientation(d) for d in datas], "cpu", keys,
                         backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(JPEGS))
def test_each_jpeg_decodes_to_the_current_paths_pixels(backend, name):
    data = JPEGS[name]
    [decoded] = _decode([data], backend)
    expected = _current(data)
    assert decoded.dtype == torch.uint8 and decoded.shape == expected.shape
    assert int((decoded.int() - expected.int()).abs().max()) == 0  # identical, not merely close


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_batch_of_every_kind_keeps_order_and_pixels(backend):
    names = sorted(JPEGS)
    decoded = _decode([JPEGS[n] for n in names], backend)
    for name, image in zip(names, decoded):
        assert torch.equal(image, _current(JPEGS[name])), name


def test_torchcodec_is_the_default_where_it_loads():
    assert jpeg_backend() == ("torchcodec" if torchcodec_usable else "torchvision")
    assert set(JPEG_BACKENDS) == {"torchcodec", "torchvision"}
    with pytest.raises(InputError, match="JPEG backend 'nvjpeg' is unknown"):
        _decode([JPEGS["rgb-420"]], "nvjpeg")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("damage", ["garbage", "truncated", "not-a-jpeg"])
def test_damaged_jpeg_gives_the_same_typed_error(backend, damage):
    good = JPEGS["rgb-420"]
    bad = {"garbage": b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4, "truncated": good[: len(good) // 2],
           "not-a-jpeg": b"GIF89a, say the bytes"}[damage]
    with pytest.raises(CorruptDataError) as caught:
        _decode([good, bad], backend, keys=["good", "bad"])
    assert caught.value.key == "bad"
    with pytest.raises(CorruptDataError) as reference:
        _decode([good, bad], "torchvision", keys=["good", "bad"])
    # PIL names the buffer object by its address: the same message apart from that.
    assert re.sub(" at 0x[0-9a-f]+", "", str(caught.value)) == re.sub(" at 0x[0-9a-f]+", "", str(reference.value))
    assert str(caught.value).startswith("[sample bad]: cannot decode image (")


def test_torchvisions_deprecation_is_silenced_for_its_call_only():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _decode([JPEGS["rgb-420"], JPEGS["grayscale"]], "torchvision")
        assert not [w for w in seen if "TorchVision" in str(w.message)]
        from torchvision.io import decode_jpeg

        decode_jpeg(torch.frombuffer(bytearray(JPEGS["rgb-420"]), dtype=torch.uint8))
    if tuple(int(p) for p in __import__("torchvision").__version__.split(".")[:2]) >= (0, 29):
        # Outside our call the notice is still there: nothing filtered it for the rest of the process.
        assert [w for w in seen if issubclass(w.category, DeprecationWarning) and "TorchVision" in str(w.message)]


BROKEN_TORCHCODEC = {
    "absent": None,
    "built for another torch": 'raise OSError("libtorchcodec_core8.so: undefined symbol: _ZN3c104impl3cow")',
    "refuses this torch": 'raise RuntimeError("torchcodec was built for torch 2.99; this is another version")',
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BROKEN_TORCHCODEC))
def test_an_unusable_torchcodec_falls_back_to_torchvision(tmp_path, case):
    body = BROKEN_TORCHCODEC[case]
    path = [str(ROOT)]
    if body is None:  # absent: a finder that says there is no such package, as on a machine without it
        (tmp_path / "sitecustomize.py").write_text(
            "import sys\n"
            "class Hide:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'torchcodec':\n"
            "            raise ModuleNotFoundError(name, name=name)\n"
            "sys.meta_path.insert(0, Hide())\n")
    else:  # installed, but its libraries do not load: a package that fails the way torchcodec's .so does
        (tmp_path / "torchcodec" / "decoders").mkdir(parents=True)
        (tmp_path / "torchcodec" / "__init__.py").write_text("")
        (tmp_path / "torchcodec" / "decoders" / "__init__.py").write_text(body + "\n")
    script = (
        "import sys, warnings, numpy as np, torch\n"
        "from shards.image.decode import decode_image\n"
        "from shards.image.device import decode_images, exif_orientation, jpeg_backend\n"
        "warnings.simplefilter('error', DeprecationWarning)  # torchvision's notice must not reach the user\n"
        "data = sys.stdin.buffer.read()\n"
        "[image] = decode_images([data], ['jpg'], [exif_orientation(data)], 'cpu')\n"
        "expected = torch.from_numpy(np.asarray(decode_image(data)).copy()).permute(2, 0, 1)\n"
        "print(jpeg_backend(), torch.equal(image, expected))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *path]))
    result = subprocess.run([sys.executable, "-c", script], input=JPEGS["exif-orientation-6"], env=env,
                            capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    assert result.stdout.decode().split() == ["torchvision", "True"]
