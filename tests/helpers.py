"""Tiny generated datasets for tests: images whose class is visible in their colour, so models can learn them."""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import random
import threading
from pathlib import Path
from typing import Iterator, Sequence

from PIL import Image

from shards.manifest import DatasetManifest, ShardInfo, SplitInfo
from shards.provenance import SourceInfo
from shards.formats.sample import RawSample
from shards.transport.storage import get_storage, shard_name

class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serve_folder(folder: Path) -> Iterator[str]:
    """``folder`` over http on loopback: yields its base URL."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


PALETTE = [(220, 30, 30), (30, 200, 40), (40, 60, 230), (230, 220, 40), (200, 40, 220), (40, 220, 220)]


def class_image(label: int, index: int, size: tuple[int, int] = (48, 40), fmt: str = "JPEG") -> bytes:
    """An image of class ``label``: its colour plus seeded noise, so samples differ but classes separate."""
    rng = random.Random(label * 100003 + index)
    base = PALETTE[label % len(PALETTE)]
    image = Image.new("RGB", size, base)
    pixels = image.load()
    for _ in range(size[0] * size[1] // 6):
        x, y = rng.randrange(size[0]), rng.randrange(size[1])
        pixels[x, y] = tuple(max(0, min(255, c + rng.randint(-60, 60))) for c in base)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, quality=90) if fmt == "JPEG" else image.save(buffer, format=fmt)
    return buffer.getvalue()


def write_image_folder(root: Path, classes: Sequence[str], per_class: int, size=(48, 40)) -> Path:
    """``root/<class>/<i>.jpg`` with class-coloured images."""
    for label, name in enumerate(classes):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (folder / f"img_{i:04d}.jpg").write_bytes(class_image(label, i, size))
    return root


def colour_shards(out: Path, size: tuple[int, int] = (32, 32)) -> Path:
    """3 colour-coded classes of JPEGs in uneven tar shards (train 20/14/14, val 12): the tests' small image set."""
    make_shard_dataset(out, classes=("red", "green", "blue"), shard_sizes={"train": [20, 14, 14], "val": [12]},
                       size=size)
    return out


def make_shard_dataset(
    out: Path,
    *,
    classes: Sequence[str] = ("a", "b", "c"),
    shard_sizes: dict[str, Sequence[int]] | None = None,
    storage: str = "tar",
    size: tuple[int, int] = (48, 40),
) -> DatasetManifest:
    """Write shards and a ``dataset.json`` directly with the writers (no packer), labels round-robin."""
    shard_sizes = shard_sizes or {"train": [7, 5, 9, 3], "val": [6, 6]}
    out.mkdir(parents=True, exist_ok=True)
    writer_type = get_storage(storage).writer
    splits = {}
    for split, sizes in shard_sizes.items():
        shards, counts, n = [], [0] * len(classes), 0
        for index, count in enumerate(sizes):
            name = shard_name(split, index, storage)
            with writer_type(out / name, classes=classes) as writer:
                for _ in range(count):
                    label = n % len(classes)
                    key = f"{split}_{n:05d}"
                    meta = json.dumps({"path": f"{classes[label]}/{key}.jpg", "class": classes[label]}).encode()
                    writer.write(RawSample(key, class_image(label, n + (0 if split == "train" else 50000), size),
                                           "jpg", label, meta))
                    counts[label] += 1
                    n += 1
            shards.append(ShardInfo(name, writer.samples, writer.bytes, writer.sha256))
        splits[split] = SplitInfo(n, tuple(counts), tuple(shards))
    manifest = DatasetManifest(
        storage=storage,
        classes=tuple(classes),
        splits=splits,
        source=SourceInfo(kind="generated", root="", files_seen=sum(s.samples for s in splits.values())),
        packing={"seed": 0},
    )
    manifest.save(out)
    return manifest


def pax_record(keyword: bytes, value: bytes) -> bytes:
    """``"<len> <keyword>=<value>\\n"``, its length field right (it counts itself)."""
    body = b" " + keyword + b"=" + value + b"\n"
    length = len(body) + 1
    while len(str(length).encode()) + len(body) != length:
        length += 1
    return str(length).encode() + body
