"""Generated source files of every kind pack-shards meets: modes, formats, broken files and awkward names."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from tests.helpers import class_image


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def rgb_image(size=(40, 30), colour=(200, 40, 40)) -> Image.Image:
    array = np.zeros((size[1], size[0], 3), dtype=np.uint8)
    array[...] = colour
    array[: size[1] // 3, : size[0] // 3] = (20, 20, 220)  # a blue top-left corner, to see rotations
    return Image.fromarray(array)


def exif_rotated_jpeg(size=(40, 20), orientation: int = 6) -> bytes:
    """Stored ``size`` wide, but EXIF says rotate: displayed ``size[1]`` x ``size[0]``."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(rgb_image(size), "JPEG", quality=95, exif=exif.tobytes())


def sixteen_bit_png(size=(32, 24)) -> bytes:
    ramp = np.linspace(0, 65535, size[0] * size[1], dtype=np.uint16).reshape(size[1], size[0])
    return encode(Image.fromarray(ramp), "PNG")


def rgba_png(size=(32, 24)) -> bytes:
    image = Image.new("RGBA", size, (255, 0, 0, 0))  # fully transparent: must come out white, not red or black
    image.paste((0, 0, 255, 255), (0, 0, size[0] // 2, size[1]))
    return encode(image, "PNG")


def palette_png(size=(32, 24)) -> bytes:
    return encode(rgb_image(size).convert("P", palette=Image.Palette.ADAPTIVE, colors=8), "PNG")


def cmyk_jpeg(size=(32, 24)) -> bytes:
    return encode(rgb_image(size).convert("CMYK"), "JPEG", quality=90)


def truncated_jpeg(size=(96, 96)) -> bytes:
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    data = encode(noisy, "JPEG", quality=95)
    return data[: len(data) // 2]


def huge_png_header(width: int = 30000, height: int = 20000) -> bytes:
    """A tiny file whose PNG header claims a huge image: it must be rejected without decoding anything."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


GOOD_KINDS = {
    "jpeg": lambda: class_image(0, 1),
    "png": lambda: encode(rgb_image(), "PNG"),
    "webp": lambda: encode(rgb_image(), "WEBP", quality=90),
    "gray": lambda: encode(rgb_image().convert("L"), "PNG"),
    "rgba": rgba_png,
    "palette": palette_png,
    "cmyk": cmyk_jpeg,
    "sixteen_bit": sixteen_bit_png,
    "exif_rotated": exif_rotated_jpeg,
}
GOOD_SUFFIX = {"jpeg": ".jpg", "webp": ".webp", "cmyk": ".jpeg", "exif_rotated": ".JPG"}


def write_mixed_tree(root: Path) -> dict[str, str]:
    """``root/{animals,plants}/...``: every good kind, broken files, awkward names. Returns rel path -> kind."""
    made: dict[str, str] = {}

    def put(rel: str, data: bytes, kind: str) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        made[rel] = kind

    for name, make in GOOD_KINDS.items():
        put(f"animals/{name}{GOOD_SUFFIX.get(name, '.png')}", make(), name)
    for i in range(3):
        put(f"plants/img_{i:04d}.jpg", class_image(1, i), "jpeg")
    put("animals/img_0000.jpg", class_image(0, 7), "jpeg")  # same name as in plants
    put("plants/nested/deeper/leaf.png", encode(rgb_image(colour=(20, 200, 20)), "PNG"), "png")
    put("plants/Ünïcødé café 猫.jpg", class_image(1, 9), "jpeg")
    put("plants/truncated.jpg", truncated_jpeg(), "truncated")
    put("plants/zero.jpg", b"", "zero")
    put("plants/notes-not-an-image.jpg", b"just some text, not a picture\n" * 4, "text")
    put("plants/huge.png", huge_png_header(), "huge")
    (root / "animals" / ".hidden.jpg").write_bytes(class_image(0, 3))
    (root / "animals" / "readme.txt").write_text("not an image extension")
    return made


BROKEN_KINDS = ("truncated", "zero", "text", "huge")
