"""The fuzz targets of adopted WebDataset tars (``shards index``): the row index, the index's scan of a tar, and
the reader over a tar that changed under a fixed index. Beyond "reads or raises a ``ShardcacheError``", every
sample served must be exactly one the index recorded (key, image bytes, label): never a wrong pairing."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, Iterable

from tests.fuzz import formats, readers
from tests.fuzz.mutate import mutate_bytes
from tests.fuzz.registry import target
from tests.fuzz.seeds import BUILDERS, Seeds

TAR = "a-000.tar"


def _adopted(seeds: Seeds, out: Path) -> None:
    """One tar of 4 samples (image, label, ``.json``, a caption) adopted by ``shards index``."""
    import webdataset as wds

    from preprocess.adopt.index import index_tars

    (out / "src").mkdir(parents=True)
    rng = random.Random(42)
    with wds.TarWriter(str(out / "src" / TAR)) as writer:
        for i in range(4):
            writer.write({"__key__": f"s{i:03d}", "jpg": rng.randbytes(300), "cls": i % 2,
                          "json": {"n": i, "name": f"sample {i}"}, "txt": f"caption {i}"})
    index_tars(str(out / "src"), str(out / "index"), label_member="cls", quiet=True)


BUILDERS["adopted"] = _adopted


def _truth(folder: Path) -> dict[str, tuple[bytes, int, bytes]]:
    """Each indexed sample as the valid artifact serves it: key -> (image, label, ``.json``)."""
    from shards.formats.adopted import iter_adopted_slice

    rows, _ = _rows(folder)
    return {s.key: (s.data, s.label, s.meta) for s in iter_adopted_slice(folder / "src" / TAR, offsets=rows)}


def _rows(folder: Path, data: bytes | None = None) -> tuple[Any, Any]:
    """The checked row index (``data`` in place of the file's bytes, its sha256 not held) and the shard's entry."""
    from shards.formats.adopted import checked_rows
    from shards.manifest import load_dataset_manifest

    info = load_dataset_manifest(folder / "index").splits["train"].shards[0]
    raw = (folder / "index" / info.index).read_bytes() if data is None else data
    loose = dataclasses.replace(info, index_sha256=None, bytes=(folder / "src" / TAR).stat().st_size)
    return checked_rows(raw, "fuzzed.rows", loose), info


def _paired(items: Iterable[Any], truth: dict[str, tuple[bytes, int, bytes]], *, labels: bool = True) -> int:
    """Drain ``items``; each sample must be one the index recorded, whole (its key, image, ``.json`` and, with
    ``labels``, label: a row index rewritten with its sha256 re-recorded may relabel rows, nothing more)."""
    from shards.formats.sample import RawSample

    count = 0
    for count, item in enumerate(items, 1):
        if count > readers.MAX_ITEMS:
            raise AssertionError("the reader yielded more items than a tiny artifact holds")
        if not isinstance(item, RawSample):
            continue
        image, label, meta = truth.get(item.key, (None, None, None))
        if (item.data, item.meta) != (image, meta) or (labels and item.label != label):
            raise AssertionError(f"served {item.key!r} with bytes or a label the index did not record for it")
    return count


def _stream(folder: Path, on_error: str, truth: dict[str, tuple[bytes, int, bytes]]) -> None:
    import shards

    dataset = shards.open_dataset(folder / "index", "train", remote=shards.Remote(base_url=str(folder / "src")),
                                  return_keys=True, decode=shards.Decode(decoder=lambda sample, seed: sample.data),
                                  sampling=shards.Sampling(shuffle=False), errors=shards.ErrorPolicy(on_error))
    for data, label, key in dataset:
        if key not in truth or truth[key][:2] != (bytes(data), int(label)):
            raise AssertionError(f"streamed {key!r} with bytes or a label the index did not record for it")


def _policy(data: bytes) -> str:
    return ("raise", "skip")[sum(data[:64]) % 2]


@target("adopt_rows", lambda seeds: (seeds.path("adopted") / "index" / f"{TAR}.rows").read_bytes(), mutate_bytes,
        examples=200)
def _adopt_rows(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards.formats.adopted import iter_adopted_slice

    folder = seeds.path("adopted")
    rows, _ = _rows(folder, data)
    _paired(iter_adopted_slice(folder / "src" / TAR, offsets=rows, resync=True), _truth(folder), labels=False)


@target("adopt_reader", lambda seeds: (seeds.path("adopted") / "src" / TAR).read_bytes(), formats.mutate_tar,
        examples=200)
def _adopt_reader(data: bytes, seeds: Seeds, work: Path) -> None:
    from shards.formats.adopted import iter_adopted_slice, iter_adopted_stream

    truth = _truth(seeds.path("adopted"))
    folder = seeds.copy("adopted", work)
    (folder / "src" / TAR).write_bytes(data)
    rows, _ = _rows(folder)
    _paired(iter_adopted_slice(folder / "src" / TAR, offsets=rows, resync=True), truth)
    with open(folder / "src" / TAR, "rb") as stream:  # a server without ranges: the stream from byte 0
        _paired(iter_adopted_stream(stream, TAR, rows, 1, len(rows), resync=True, from_start=True), truth)
    _stream(folder, _policy(data), truth)


@target("adopt_scan", lambda seeds: (seeds.path("adopted") / "src" / TAR).read_bytes(), formats.mutate_tar,
        examples=100)
def _adopt_scan(data: bytes, seeds: Seeds, work: Path) -> None:
    from preprocess.adopt.index import index_tars
    from shards.formats.adopted import iter_adopted_slice

    src = work / "src"
    src.mkdir()
    (src / TAR).write_bytes(data)
    report = index_tars(str(src), str(work / "index"), label_member="cls", quiet=True)
    if not report.samples.get("train"):
        return
    rows, _ = _rows(work)
    for sample in iter_adopted_slice(src / TAR, offsets=rows):  # what it indexed reads back whole, unskipped
        readers.drain([sample])
