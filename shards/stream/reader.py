"""``open_dataset``: from a manifest (folder, file or URL) and plain options to the right streaming dataset.

This is the one place that turns user-facing conveniences (a preset name for the transform, ``class_weights=
"balanced"``, ``draft=True``, rank and world size read from ``torch.distributed``) into the explicit
``StreamConfig`` and decoder the datasets take.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

from shards.stream.dataset import ImageShardDataset, ShardDataset, StreamConfig
from shards.image.decode import ImageDecoder
from shards.errors import InputError
from shards.image.fast import FastDecoder
from shards.stream.feature_stream import FeatureShardDataset
from shards.manifest import DATASET_FILE, DatasetManifest, FeatureManifest, Manifest, load_manifest
from shards.formats.remote import is_remote, join_location, read_remote_json
from shards.stream.stages import class_weights_from_counts
from shards.image.transforms import TransformSpec, build_transform


def distributed_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` from ``torch.distributed`` when a process group is up, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _load(path: str | os.PathLike) -> tuple[Manifest, str]:
    """The manifest and the base its shard paths are relative to."""
    text = str(path)
    if is_remote(text):
        url = text if text.endswith(".json") else text.rstrip("/") + "/" + DATASET_FILE
        return DatasetManifest.from_dict(read_remote_json(url), where=url), url.rsplit("/", 1)[0]
    manifest = load_manifest(path)
    folder = Path(path)
    return manifest, str(folder.parent if folder.is_file() else folder)


def _resolve_weights(option: str | Sequence[float] | None, class_counts: Sequence[int]) -> tuple[float, ...] | None:
    if option is None:
        return None
    if isinstance(option, str):
        if option != "balanced":
            raise InputError(f"class_weights must be 'balanced' or one weight per class, got {option!r}")
        return tuple(class_weights_from_counts(class_counts))
    weights = tuple(float(w) for w in option)
    if len(weights) != len(class_counts):
        raise InputError(f"class_weights has {len(weights)} entries, the dataset has {len(class_counts)} classes")
    return weights


def _resolve_transform(transform: Any, draft: bool | int | tuple[int, int] | None) -> tuple[Callable | None,
                                                                                            tuple[int, int] | None]:
    spec = TransformSpec(preset=transform) if isinstance(transform, str) else transform
    draft_size = None
    if draft is True:
        if not isinstance(spec, TransformSpec):
            raise InputError("draft=True needs the transform as a preset name or TransformSpec; "
                             "otherwise give the minimum decoded size, e.g. draft=256")
        draft_size = spec.draft_size
    elif isinstance(draft, int) and not isinstance(draft, bool):
        draft_size = (draft, draft)
    elif draft:
        draft_size = (int(draft[0]), int(draft[1]))
    if isinstance(spec, TransformSpec):
        return build_transform(spec), draft_size
    return spec, draft_size


PIPELINES = ("standard", "fast")


def _fast_spec(transform: Any) -> TransformSpec:
    if transform is None:
        return TransformSpec(preset="eval")
    if isinstance(transform, str):
        return TransformSpec(preset=transform)
    if isinstance(transform, TransformSpec):
        return transform
    raise InputError("the fast pipeline needs the transform as a preset name or TransformSpec, not a callable")


def open_dataset(path: str | os.PathLike, split: str = "train", *,
                 transform: Callable | str | TransformSpec | None = None, shuffle: bool = True, seed: int = 0,
                 rank: int | None = None, world_size: int | None = None,
                 return_keys: bool = False, drop_last: bool = False, shuffle_buffer: int = 512,
                 class_weights: str | Sequence[float] | None = None, weight_window: int = 1024,
                 on_error: str = "raise", max_consecutive_errors: int = 10,
                 draft: bool | int | tuple[int, int] | None = None, decoder: Callable | None = None,
                 pipeline: str = "standard", cache: str = "auto", base_url: str | None = None) -> ShardDataset:
    """Stream one split of a ``dataset.json`` (images) or ``features.json`` (features).

    Yields ``(sample, label)`` or ``(sample, label, key)``; the sample is an RGB PIL image (or ``transform`` of
    it) for image shards and a feature tensor for feature shards. ``base_url`` fetches shards from
    ``base_url/<shard path>`` instead of next to the manifest.

    ``pipeline="fast"`` (image shards, ``transform`` a preset name or ``TransformSpec``) yields uint8
    [3, size, size] tensors made by crop-then-resize with DCT-scaled JPEG decoding; normalise each batch on the
    consuming device with ``shards.image.fast.Normalize(spec.mean, spec.std)`` (or ``dataset.decoder.normalizer()``).
    """
    manifest, base = _load(path)
    split_info = manifest.split(split)
    if rank is None or world_size is None:
        auto_rank, auto_world = distributed_rank_world()
        rank = auto_rank if rank is None else rank
        world_size = auto_world if world_size is None else world_size
    config = StreamConfig(
        split=split, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last,
        shuffle_buffer=shuffle_buffer, class_weights=_resolve_weights(class_weights, split_info.class_counts),
        weight_window=weight_window, on_error=on_error, max_consecutive_errors=max_consecutive_errors,
        return_keys=return_keys)
    root = base_url if base_url is not None else base
    locations = [join_location(root, s.path) if is_remote(root) or is_remote(s.path) else str(Path(root) / s.path)
                 for s in split_info.shards]
    if isinstance(manifest, FeatureManifest):
        if transform is not None or decoder is not None or draft:
            raise InputError("transform, decoder and draft apply to image shards, not to feature shards")
        return FeatureShardDataset(split_info, locations, config, cache=cache, num_classes=len(manifest.classes))
    if pipeline not in PIPELINES:
        raise InputError(f"pipeline {pipeline!r} is unknown; choose one of {list(PIPELINES)}")
    if pipeline == "fast":
        if decoder is not None or draft:
            raise InputError("the fast pipeline chooses its own decoder and draft; drop decoder/draft")
        decoder = FastDecoder(_fast_spec(transform))
    elif decoder is None:
        image_transform, draft_size = _resolve_transform(transform, draft)
        decoder = ImageDecoder(image_transform, draft_size=draft_size)
    elif transform is not None or draft:
        raise InputError("give either a decoder or transform/draft, not both")
    return ImageShardDataset(split_info, locations, config, storage=manifest.storage, decoder=decoder,
                             num_classes=len(manifest.classes))
