"""The valid artifacts the fuzz targets start from, each built once per process in one temporary folder.

Everything is tiny (8x8 images, a few samples per shard) and made the way users make it: datasets by
``pack_shards``, feature folders by the writers, a run folder by ``train``, a saved loader state by a real loader.
Building is deterministic, so a corpus input saved by one run still fits the artifact built by another.
"""

from __future__ import annotations

import atexit
import io
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

CLASSES = ("ant", "bee")
IMAGE_SIZE = (8, 8)


class Seeds:
    """Lazily built artifacts under one folder: ``seeds.path("tar_dataset")`` builds it on first use. A finished
    artifact is marked on disk, so a forked reader sees what its parent built (and never half of it)."""

    def __init__(self, root: Path | None = None):
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="shardcache-fuzz-seeds-"))
            atexit.register(shutil.rmtree, root, True)
        self.root = root

    def path(self, name: str) -> Path:
        target = self.root / name
        if not (self.root / f"{name}.built").exists():
            if target.exists():
                shutil.rmtree(target)
            BUILDERS[name](self, target)
            (self.root / f"{name}.built").touch()
        return target

    def copy(self, name: str, into: Path) -> Path:
        """A private copy of artifact ``name`` under ``into`` (a reader may be handed it to damage)."""
        target = into / name
        shutil.copytree(self.path(name), target, symlinks=True)
        return target


def _image_folder(seeds: Seeds, out: Path) -> None:
    from tests.helpers import write_image_folder

    write_image_folder(out, CLASSES, 3, size=IMAGE_SIZE)


def _packed(storage: str) -> Callable[[Seeds, Path], None]:
    def build(seeds: Seeds, out: Path) -> None:
        from preprocess.pack.packer import PackConfig, pack_manifest

        pack_manifest(PackConfig(str(seeds.path("images")), str(out), storage=storage, max_samples=2,
                                 val_fraction=0.34, quiet=True))
        shutil.rmtree(out / ".pack", ignore_errors=True)  # the packer's own bookkeeping: not read by readers
    return build


def _features(storage: str) -> Callable[[Seeds, Path], None]:
    def build(seeds: Seeds, out: Path) -> None:
        from tests.shards.stream_helpers import write_feature_dataset

        write_feature_dataset(out, [3, 2], dim=4, classes=CLASSES, storage=storage)
    return build


def _lists(seeds: Seeds, out: Path) -> None:
    """``list.csv`` and ``list.jsonl`` naming the image folder's files (relative to the list's folder)."""
    images = seeds.copy("images", out)
    rows = sorted((p.relative_to(out).as_posix(), p.parent.name) for p in images.rglob("*.jpg"))
    (out / "list.csv").write_text("path,label,split\n" + "".join(
        f"{path},{label},{'val' if i % 3 == 2 else 'train'}\n" for i, (path, label) in enumerate(rows)))
    (out / "list.jsonl").write_text("".join(
        json.dumps({"path": path, "label": label, "split": "val" if i % 3 == 2 else "train"}) + "\n"
        for i, (path, label) in enumerate(rows)))


def hf_metadata(names=CLASSES) -> bytes:
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": list(names)}}
    return json.dumps({"info": {"features": features}}).encode()


def image_table(rows: int = 4, metadata: bytes | None = None):
    """An Arrow table as the Hub stores images: ``{bytes, path}`` structs, ClassLabel ints, a scalar column."""
    import pyarrow as pa

    from tests.helpers import class_image

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({
        "image": pa.array([{"bytes": class_image(i % 2, i, size=IMAGE_SIZE), "path": f"img{i}.jpg"}
                           for i in range(rows)], image),
        "label": pa.array([i % 2 for i in range(rows)], pa.int64()),
        "caption": [f"row {i}" for i in range(rows)],
    })
    return table.replace_schema_metadata({b"huggingface": metadata if metadata is not None else hf_metadata()})


def write_parquet(path: Path, table) -> None:
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=2)


def _parquet(seeds: Seeds, out: Path) -> None:
    write_parquet(out / "train-00000-of-00001.parquet", image_table())


def _arrow(seeds: Seeds, out: Path) -> None:
    """What ``datasets.DatasetDict.save_to_disk`` writes for one split: Arrow IPC stream files and JSON records."""
    import pyarrow as pa

    split = out / "train"
    split.mkdir(parents=True)
    table = image_table()
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    (split / "data-00000-of-00001.arrow").write_bytes(sink.getvalue())
    (out / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    (split / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                  "_fingerprint": "0" * 16, "_format_type": None, "_split": "train"}))
    (split / "dataset_info.json").write_text(json.dumps({"features": {
        "image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": list(CLASSES)},
        "caption": {"_type": "Value", "dtype": "string"}}}))


def _run(seeds: Seeds, out: Path) -> None:
    """A 2-epoch linear-head run on a feature folder (``out/run``, ``out/cache/{features,dataset}``)."""
    from tests.train.conftest import write_feature_folder
    from tests.train.configs import train_config
    from train.run.loop import train

    features = write_feature_folder(out / "cache", shard_sizes={"train": [6, 4], "val": [4]}, classes=CLASSES,
                                    dim=4)
    train(train_config(str(features), str(out / "run"), epochs=2, batch_size=4, quiet=True,
                      device="cpu", workers=0, prefetch=0, stall_timeout=0))


def _loader_state(seeds: Seeds, out: Path) -> None:
    """``state.json``: a worker-process loader's state after one batch of the packed tar dataset's train split."""
    from tests.fuzz.readers import tar_loader

    out.mkdir(parents=True)
    loader = tar_loader(seeds.path("tar_dataset"))
    next(iter(loader))
    (out / "state.json").write_text(json.dumps(loader.state_dict(), sort_keys=True))


def _node_cache(seeds: Seeds, out: Path) -> None:
    """A node cache folder holding two shards (limit: room for two), as a reader left it."""
    from tests.fuzz.readers import blob, fill_cache
    from shards.cache.node import NodeCache, ShardCache

    cache = NodeCache(ShardCache(out, limit=2 * len(blob("a")[0])))
    for name in ("a", "b"):
        fill_cache(cache, *blob(name)).release()


BUILDERS: dict[str, Callable[[Seeds, Path], None]] = {
    "images": _image_folder,
    "tar_dataset": _packed("tar"),
    "hdf5_dataset": _packed("hdf5"),
    "pt_features": _features("pt"),
    "h5_features": _features("hdf5"),
    "lists": _lists,
    "parquet": _parquet,
    "arrow": _arrow,
    "run": _run,
    "loader_state": _loader_state,
    "node_cache": _node_cache,
}
