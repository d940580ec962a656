"""The public readers the fuzz targets call, used the way a user's code uses them, and the artifact edits a
targeted input needs (an attacker who can write a shard can write its manifest entry too, so checksums are
re-recorded and only the checks that hold without them are tested).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable

import torch

MAX_ITEMS = 100_000  # a reader of a tiny artifact that yields more than this is looping


def drain(items: Iterable[Any]) -> int:
    """Consume ``items``; an endless reader is a failure, not a hang of the test."""
    count = 0
    for count, _ in enumerate(items, 1):
        if count > MAX_ITEMS:
            raise AssertionError(f"the reader yielded more than {MAX_ITEMS} items from a tiny artifact")
    return count


def image_size(image: Any) -> torch.Tensor:
    """A transform that keeps batches collatable whatever a damaged image decodes to (the decode still happens)."""
    return torch.tensor(getattr(image, "size", (0, 0)))


def stream_split(source: Any, split: str = "train", *, on_error: str = "raise", images: bool = True,
                 **options: Any) -> int:
    """Every sample of ``split`` of ``source`` (a folder or a ``SourceSpec``) through ``open_dataset`` (in
    process), images decoded."""
    from shards import ErrorPolicy, Sampling, open_dataset

    source = str(source) if isinstance(source, Path) else source
    dataset = open_dataset(source, split, transform=image_size if images else None,
                           sampling=Sampling(shuffle=False), errors=ErrorPolicy(on_error=on_error), **options)
    return drain(dataset)


def tar_loader(folder: Path, **options: Any) -> Any:
    """A loader over the train split, in process (batches of 2)."""
    from shards import open_dataset
    from shards.loader.in_process import InProcess
    from shards.loader.loader import make_loader

    dataset = open_dataset(str(folder), "train", transform=image_size, seed=3, **options)
    return make_loader(dataset, batch_size=2, mode=InProcess(), drop_last=False, stage_times=False)


def verify(folder: Path | str) -> Any:
    from shards.check.verify import verify_dataset

    return verify_dataset(str(folder), full=True, quiet=True)


def report(folder: Path | str) -> str:
    from shards.report.build import build_report

    return build_report([str(folder)], grid=False)


def rerecord(manifest_file: Path, name: str, data: bytes) -> None:
    """Record ``data`` as the bytes of the file the manifest calls ``name``: every entry naming it as its
    ``path`` gets its size and sha256, as its ``index`` its ``index_sha256``. Leaves an unreadable manifest alone."""
    try:
        manifest = json.loads(manifest_file.read_text())
    except ValueError:
        return
    digest = hashlib.sha256(data).hexdigest()

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("path") == name:
                if "bytes" in node:
                    node["bytes"] = len(data)
                if "sha256" in node:
                    node["sha256"] = digest
            if node.get("index") == name and "index_sha256" in node:
                node["index_sha256"] = digest
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(manifest)
    manifest_file.write_text(json.dumps(manifest, indent=1))


def replace_file(folder: Path, name: str, data: bytes, manifest: str = "dataset.json") -> Path:
    """Write ``data`` as ``folder/name`` and re-record it in ``folder/manifest``."""
    path = folder / name
    path.write_bytes(data)
    if (folder / manifest).is_file() and name != manifest:
        rerecord(folder / manifest, name, data)
    return path


# -- the node cache -----------------------------------------------------------------------------------------------
def blob(name: str) -> tuple[bytes, str]:
    data = (f"shard {name} ".encode() * 40)[:400]
    return data, hashlib.sha256(data).hexdigest()


def fill_cache(cache: Any, data: bytes, sha: str) -> Any:
    return cache.acquire(sha, len(data), ".tar", lambda out: out.write(data), f"source-{sha[:6]}")


def use_cache(root: Path) -> None:
    """What readers of a shared node cache do: open it (which cleans leftovers), read the live plans, fetch a
    shard that needs room (eviction reads plans and reservations), hit the cached ones (stamps), verify all."""
    from shards.cache.node import NodeCache, ShardCache
    from shards.cache.plan_view import live_plans, next_uses

    cache = NodeCache(ShardCache(root, limit=2 * len(blob("a")[0])))
    next_uses(live_plans(cache.root))
    for name in ("c", "a", "b"):
        lease = fill_cache(cache, *blob(name))
        if lease is not None:
            lease.release()
    cache.verify_all()
    cache.clean_stale()
