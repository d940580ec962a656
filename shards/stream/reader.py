"""``open_dataset``: from a manifest (folder, file or URL) and plain options to the right streaming dataset.

This is the one place that turns user-facing conveniences (a preset name for the transform, ``class_weights=
"balanced"``, ``draft=True``, rank and world size read from ``torch.distributed``) into the explicit
``StreamConfig`` and decoder the datasets take. Most options arrive grouped (``shards.stream.options``, and the
node cache's ``shards.cache.node.ShardCache``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from shards.stream.dataset import Selection, ShardDataset, StreamConfig
from shards.stream.image_dataset import ImageShardDataset
from shards.select.mixture import MixOptions, SourceSpec, as_specs
from shards.order.plan import ShardSlice
from shards.select.selection import LoadedSource, combine
from shards.image.decode import ImageDecoder
from shards.errors import InputError
from shards.image.fast import FastDecoder
from shards.stream.feature_stream import FeatureShardDataset
from shards.cache.images import ImageCacheRequest
from shards.formats.features import FeatureSpec
from shards.manifest import FeatureManifest, Manifest
from shards.select.columns import open_columns
from shards.transport.location import locate
from shards.door.locations import request_origins, shard_location
from shards.transport.manifest_io import load_manifest_at
from shards.transport.storage import get_storage
from shards.stream.options import Decode, Distributed, ErrorPolicy, MemoryCache, Remote, Sampling
from shards.order.weights import class_weights_from_counts
from shards.select.labels import column_labels
from shards.select.row_keys import KeyColumns
from shards.image.transforms import TransformSpec, build_transform


def distributed_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` from ``torch.distributed`` when a process group is up, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _resolve_weights(option: str | tuple[float, ...] | None, class_counts: Sequence[int]) -> tuple[float, ...] | None:
    if option is None:
        return None
    if option == "balanced":
        return tuple(class_weights_from_counts(class_counts))
    if len(option) != len(class_counts):
        raise InputError(f"Sampling.class_weights has {len(option)} entries, the dataset has {len(class_counts)} "
                         "classes")
    return tuple(option)


def _resolve_transform(transform: Any, draft: bool) -> tuple[Callable | None, tuple[int, int] | None]:
    spec = TransformSpec(preset=transform) if isinstance(transform, str) else transform
    if draft and not isinstance(spec, TransformSpec):
        raise InputError("Decode.draft=True needs the transform as a preset name or TransformSpec; for a callable "
                         "transform pass decoder=ImageDecoder(transform, draft_size=(width, height))")
    draft_size = spec.draft_size if draft else None
    if isinstance(spec, TransformSpec):
        return build_transform(spec), draft_size
    return spec, draft_size


def _fast_spec(transform: Any) -> TransformSpec:
    if transform is None:
        return TransformSpec(preset="eval")
    if isinstance(transform, str):
        return TransformSpec(preset=transform)
    if isinstance(transform, TransformSpec):
        return transform
    raise InputError("the fast pipeline needs the transform as a preset name or TransformSpec, not a callable")


def open_dataset(path: str | os.PathLike | SourceSpec | Sequence[str | os.PathLike | SourceSpec],
                 split: str = "train", *,
                 transform: Callable | str | TransformSpec | None = None, seed: int = 0, return_keys: bool = False,
                 sampling: Sampling = Sampling(), errors: ErrorPolicy = ErrorPolicy(), decode: Decode = Decode(),
                 remote: Remote = Remote(), cache: str | MemoryCache = "auto",
                 distributed: Distributed = Distributed(), mix: MixOptions = MixOptions()) -> ShardDataset:
    """Stream one split of a ``dataset.json`` (images) or ``features.json`` (features).

    Yields ``(sample, label)`` or ``(sample, label, key)`` (``return_keys=True``); the sample is an RGB PIL image
    (or ``transform`` of it) for image shards and a feature tensor for feature shards. Everything else comes
    grouped, so a call states only what it changes: ``sampling=Sampling(shuffle=, shuffle_buffer=, class_weights=,
    balance=)`` (order and how ranks are balanced), ``errors=ErrorPolicy(...)``, ``decode=Decode(...)``,
    ``remote=Remote(base_url=, url_origins=, storage_options=, shard_cache=)`` (how shards are reached:
    ``base_url`` fetches them from ``base_url/<shard path>`` instead of next to the manifest),
    ``distributed=Distributed(rank=, world_size=, nodes=, rotate_every=)`` (rank and world size default to
    ``torch.distributed``'s; ``nodes`` keeps each shard on one node across epochs, see ``shards.Distributed``),
    ``cache`` (in memory) and ``mix`` (how several sources combine).

    ``decode=Decode("fast")`` (image shards, ``transform`` a preset name or ``TransformSpec``) yields uint8
    [3, size, size] tensors made by crop-then-resize with DCT-scaled JPEG decoding; normalise each batch on the
    consuming device with ``dataset.normalizer()`` (every dataset has one: the identity where samples come ready).

    ``remote=Remote(shard_cache=ShardCache(dir=, limit=, fallback=, local=))`` keeps whole shards fetched from
    ``s3://``, ``http(s)://`` or a network file system on local disk, shared by every rank and worker of the node,
    at most ``limit`` bytes (``"200G"``); without ``dir`` there is none; see
    ``shards.cache.cached_shards``. ``dataset.shard_cache.summary()`` counts hits, misses and bytes fetched.

    ``cache="memory"`` (or ``cache=MemoryCache(limit=, side=)``) on image shards (fast pipeline only) keeps each
    sample's decoded pixels in memory shared by the DataLoader workers, so epochs after the first skip decoding:
    the eval preset's final crops, the train preset's images bounded to ``side`` on the shorter side (default
    ``size / 0.875``; every epoch, the first included, crops from that bounded image), at most ``limit`` bytes
    (``"8G"``; default half of what the job's cgroup or the machine has left), the rest decoded every epoch; see
    ``shards.cache.images``. ``dataset.image_cache.stats()`` counts cached samples, hits and misses.
    ``"auto"`` caches only feature folders (under 4 GiB); ``"none"`` nothing.

    Several sources (a list of folders or ``shards.SourceSpec(path, weight=|repeat=|choose=, subset=)``) are read
    as one split: each fills its share of every epoch, drawn by whole shard runs from ``(seed, epoch)``. A
    source's ``subset=Subset(classes=, keys=, where=, max_samples=)`` reads only part of it without repacking (one
    folder's part: ``open_dataset(SourceSpec(path, subset=...))``); ``mix=MixOptions(class_map="union")`` mixes
    sources whose class lists differ. See ``shards.select.mixture``; ``dataset.mixture.composition()`` says what
    an epoch holds.
    """
    specs = as_specs(path)
    rank, world_size = distributed.rank, distributed.world_size
    if rank is None or world_size is None:
        auto_rank, auto_world = distributed_rank_world()
        rank = auto_rank if rank is None else rank
        world_size = auto_world if world_size is None else world_size
    config = StreamConfig(
        split=split, shuffle=sampling.shuffle, seed=seed, rank=rank, world_size=world_size,
        drop_last=sampling.balance == "drop", shuffle_buffer=sampling.shuffle_buffer, class_weights=None,
        on_error=errors.on_error,
        max_consecutive_errors=errors.max_consecutive_errors, return_keys=return_keys,
        nodes=1 if distributed.nodes is None else distributed.nodes, rotate_every=distributed.rotate_every,
        feature_window=sampling.feature_window)
    # Every hop of an http(s) request for this dataset stays on a source manifest's own origin or the caller's.
    origins = request_origins([path] if specs is None else [spec.path for spec in specs], remote.url_origins)
    node_cache = _node_cache(remote, origins)
    found = _resolve(path, specs, split, config, remote, node_cache, mix, shuffle=sampling.shuffle)
    if sampling.class_weights is not None:
        config = dataclasses.replace(config, class_weights=_resolve_weights(sampling.class_weights,
                                                                            found.split_info.class_counts))
    return _build(found.manifest, found.split_info, found.locations, config, transform=transform, decode=decode,
                  remote=remote, origins=origins, caches=_Caches.of(cache, node_cache),
                  selection=_selection(found, config), **found.per_shard)


@dataclass(frozen=True)
class _Resolved:
    """What ``open_dataset``'s path names, before anything is built: the (possibly combined) manifest, split and
    shard locations, the sources they came from, and a mixture's draw and label maps (None: one plain source)."""

    manifest: Manifest
    split_info: Any
    locations: list[str]
    per_shard: dict[str, list]
    sources: list[LoadedSource]
    mixture: Any = None
    label_maps: Sequence[Any] | None = None


def _resolve(path: Any, specs: Sequence[SourceSpec] | None, split: str, config: StreamConfig, remote: Remote,
             node_cache: Any, mix: MixOptions, *, shuffle: bool) -> _Resolved:
    """One folder as it is (``specs`` None), or several sources (or a subset) combined into one split."""
    if specs is None:
        manifest, base = load_manifest_at(path, remote.url_origins, remote.storage_options)
        split_info = manifest.split(split)
        root = remote.base_url if remote.base_url is not None else base
        locations = [shard_location(root, s.path) for s in split_info.shards]
        source = _load_source(SourceSpec(path), split, remote, config, node_cache, lambda _: (manifest, base))
        return _Resolved(manifest, split_info, locations, {"index_roots": [base] * len(locations)}, [source])
    # Parts of one folder mixed (two subsets of one dataset) parse its manifest once: 0.3 s at 1.28M samples.
    manifests: dict[str, Any] = {}

    def manifest_of(where: Any) -> Any:
        key = os.fspath(where)
        if key not in manifests:
            manifests[key] = load_manifest_at(where, remote.url_origins, remote.storage_options)
        return manifests[key]

    sources = [_load_source(spec, split, remote, config, node_cache, manifest_of) for spec in specs]
    combined = combine(sources, split, mix, seed=config.seed, shuffle=shuffle)
    return _Resolved(combined.manifest, combined.split, combined.locations,
                     _per_shard(sources, combined.mixture.runs, manifest_of), sources, combined.mixture,
                     combined.label_maps)


def _selection(found: _Resolved, config: StreamConfig) -> Selection:
    """What of the split the dataset streams, whole before it is built: the labels the order's class weighting
    draws by are read once here (a feature folder's from its shards, as the dataset is built); the key columns of
    the resume audit are opened when it asks."""
    label_maps = found.label_maps
    row_labels, from_shards = None, False
    if config.class_weights is not None:
        from_shards = isinstance(found.manifest, FeatureManifest)
        if not from_shards:
            maps = None if label_maps is None or all(m is None for m in label_maps) else list(label_maps)
            row_labels = column_labels(found.locations, maps, found.sources, len(config.class_weights))
    return Selection(tuple(found.manifest.classes), found.mixture, None if label_maps is None else tuple(label_maps),
                     row_labels, from_shards, KeyColumns(list(found.locations), found.sources))


def _load_source(spec: SourceSpec, split: str, remote: Remote, config: StreamConfig, shard_cache: Any,
                 manifest_of: Callable[[Any], Any]) -> LoadedSource:
    """One mixture source: its manifest (``manifest_of(path)``: ``(manifest, base)``), shard locations, and a plain
    reader for what a subset must look at."""
    manifest, base = manifest_of(spec.path)
    split_info = manifest.split(split, where=spec.path)
    root = spec.source if spec.source is not None else remote.base_url if remote.base_url is not None else base
    locations = [shard_location(root, s.path) for s in split_info.shards]
    # What shardcache wrote (columns, source index) is beside the shards, or, for tars adopted in place
    # (``shards index``), beside the manifest: the tars' folder is not ours.
    own = base if _adopted(manifest) else root
    folder = str(own) if locate(own).local_path() is not None else None  # the source index: local folders only
    plain = dataclasses.replace(config, shuffle=False, class_weights=None, return_keys=False, rank=0, world_size=1,
                                nodes=1, rotate_every=0)
    readers: list[ShardDataset] = []

    def read_all(shard: int) -> Any:
        if not readers:  # a plain reader of this source, made only when a shard must be read to be filtered
            readers.append(_build(manifest, split_info, locations, plain, transform=None, decode=Decode(),
                                  remote=remote, origins=request_origins([spec.path], remote.url_origins),
                                  caches=_Caches("none", shard_cache), index_roots=[base] * len(locations)))
        return readers[0].read_slice(ShardSlice(shard, 0, split_info.shards[shard].samples))

    def columns() -> Any:  # the split's column index, through the node cache when remote (None: packed before)
        if manifest.kind != "images":
            return None
        base = locate(own, storage_options=remote.storage_options,
                      origins=request_origins([spec.path], remote.url_origins))
        return open_columns(base, manifest, split, cache=shard_cache)

    return LoadedSource(spec, manifest, split_info, locations, folder, read_all, columns)


@dataclass(frozen=True)
class _Caches:
    """What one dataset reads through: ``open_dataset``'s ``cache`` mode, the node-local shard cache (or None) and
    the decoded-image cache's size options."""

    mode: str = "auto"
    shards: Any = None
    memory_limit: Any = None
    cache_side: int | None = None

    @classmethod
    def of(cls, cache: str | MemoryCache, shards: Any) -> _Caches:
        if isinstance(cache, MemoryCache):
            return cls("memory", shards, cache.limit, cache.side)
        return cls(cache, shards)


def _adopted(manifest: Manifest) -> bool:
    """Whether ``manifest`` describes tars adopted in place: its index files are beside it, not beside the tars."""
    return manifest.kind == "images" and get_storage(manifest.storage).load_index is not None


def _per_shard(sources: Sequence[LoadedSource], runs: Sequence[Sequence[Any]],
               manifest_of: Callable[[Any], Any]) -> dict[str, list]:
    """Each kept shard's format and the folder of its manifest (where an adopted tar's row index is), in the
    combined split's order: each source's kept shards (``runs``: one per kept shard), source by source."""
    if any(source.manifest.kind != "images" for source in sources):
        return {}
    storages, roots = [], []
    for source, kept in zip(sources, runs):
        storages += [source.manifest.storage] * len(kept)
        roots += [manifest_of(source.spec.path)[1]] * len(kept)
    return {"shard_storages": storages, "index_roots": roots}


def _build(manifest: Manifest, split_info: Any, locations: list[str], config: StreamConfig, *, transform: Any,
           decode: Decode, remote: Remote, origins: Sequence[str], caches: _Caches,
           selection: Selection | None = None, shard_storages: Sequence[str] | None = None,
           index_roots: Sequence[Any] | None = None) -> ShardDataset:
    """The streaming dataset of one (possibly combined) split, built once and whole: ``selection`` (None: the
    split's own rows, with the manifest's class names); ``origins``: where its http(s) reads may be redirected
    (``request_origins``)."""
    selection = selection if selection is not None else Selection(tuple(manifest.classes))
    return _dataset(manifest, split_info, locations, config, transform=transform, decode=decode, remote=remote,
                    origins=origins, caches=caches, selection=selection, shard_storages=shard_storages,
                    index_roots=index_roots)


def _dataset(manifest: Manifest, split_info: Any, locations: list[str], config: StreamConfig, *, transform: Any,
             decode: Decode, remote: Remote, origins: Sequence[str], caches: _Caches, selection: Selection,
             shard_storages: Sequence[str] | None = None, index_roots: Sequence[Any] | None = None) -> ShardDataset:
    split, shard_cache = config.split, caches.shards
    if isinstance(manifest, FeatureManifest):
        if transform is not None or decode.image_only or caches.memory_limit is not None \
                or caches.cache_side is not None:
            raise InputError("transform, Decode.decoder, Decode.draft and MemoryCache apply to image shards, not to "
                             "feature shards")
        # A regression table has no classes (None: no label range to check) and yields its float targets.
        return FeatureShardDataset(split_info, locations, config, spec=FeatureSpec.of(manifest), cache=caches.mode,
                                   storage_options=remote.storage_options, shard_cache=shard_cache,
                                   selection=selection)
    if config.feature_window:
        raise InputError("Sampling.feature_window orders feature shards (the in-process feature loader); image "
                         "shards are mixed by shuffle_buffer")
    images = ImageCacheRequest(caches.mode, caches.memory_limit, caches.cache_side, decode=decode.mode)
    decoder = decode.decoder
    if decode.mode == "fast":
        spec = _fast_spec(transform)
        decoder = FastDecoder(spec, source_side=images.source_side(spec))
    elif decoder is None:
        image_transform, draft_size = _resolve_transform(transform, decode.draft)
        decoder = ImageDecoder(image_transform, draft_size=draft_size)
    elif transform is not None:
        raise InputError("give either Decode.decoder or a transform, not both")
    return ImageShardDataset(split_info, locations, config, storage=manifest.storage, decoder=decoder,
                             num_classes=len(manifest.classes), storage_options=remote.storage_options,
                             url_origins=origins, shard_cache=shard_cache,
                             image_cache=images.open(decoder, split_info.samples, split),
                             shard_storages=shard_storages, index_roots=index_roots, selection=selection)


def _node_cache(remote: Remote, origins: Sequence[str] = ()):
    """The node-local shard cache ``remote`` asks for, or None. Only ``ShardCache.dir`` names its folder: the
    library reads no environment (the CLIs turn ``$SHARDCACHE_CACHE_DIR`` into ``--cache-dir``)."""
    from shards.cache.cached_shards import CachedShards

    request = remote.shard_cache
    if request.dir is None:
        if request.limit is not None:
            raise InputError("ShardCache.limit needs a ShardCache.dir")
        return None
    return CachedShards(request, remote.storage_options, origins)
