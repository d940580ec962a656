"""The grouped options of ``open_dataset``: small frozen dataclasses, each validated on entry.

``open_dataset`` keeps the everyday options flat (split, transform, seed, ...); the rest come in groups, so a call
states only what it changes: ``ErrorPolicy`` (what a corrupt sample does), ``Sampling`` (shuffling, class
weighting, how ranks are balanced), ``Decode`` (which image pipeline, PIL draft decoding, a custom decoder),
``Remote`` (how shards are reached: where they are fetched from when not beside the manifest, which hosts a
manifest may name, object storage's options, and the node-local shard cache between them and the reader),
``Distributed`` (this process's rank and the job's nodes) and ``MemoryCache`` (the decoded-image cache's size).
The node cache's own record, ``ShardCache``, lives with that cache (``shards.cache.node``).
A bad value raises a one-line ``InputError`` naming the group and field. This module imports nothing heavy, so
command-line modules can share ``DECODES`` without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shards.cache.node import ShardCache
from shards.errors import InputError

# The decode modes, one vocabulary for every command and the Python API. "standard" (PIL + torchvision ops, the
# reference) yields float tensors normalised in the workers, so any model takes them: it is the library default.
# "fast" (uint8, DCT-scaled JPEG decoding) yields uint8 tensors that the consumer normalises on its device
# (``dataset.normalizer()``), so only a caller that does that (train-from-shards) may default to it.
# "device" decodes and resizes batches on the model's device: only precompute-features has that path, and "auto"
# (precompute-features too): the device and the workers split the decoding by measured rates, the workers alone
# without an accelerator (``preprocess.features.decode_share``).
DECODES = ("standard", "fast", "device", "auto")
STREAM_DECODES = ("standard", "fast")  # what open_dataset (and so train-from-shards) can do
DEFAULT_DECODE = "standard"
ON_ERROR = ("raise", "skip")
BALANCE = ("pad", "drop")


def check_decode(decode: str, *, field: str = "decode", where: str = "open_dataset") -> str:
    """``decode`` if it is one of ``STREAM_DECODES``, what ``where`` (a command or API) can do; the one place a
    decode mode is validated for a streaming reader."""
    if decode == "device":
        raise InputError(f"{field}='device' is not available in {where}: only precompute-features decodes on the "
                         f"model's device; use one of {', '.join(STREAM_DECODES)}")
    if decode not in STREAM_DECODES:
        raise InputError(f"{field}={decode!r} is not one of {', '.join(STREAM_DECODES)}")
    return decode


@dataclass(frozen=True)
class ErrorPolicy:
    """``on_error="raise"`` stops at the first unreadable sample; ``"skip"`` logs, counts and replaces it, and
    stops after ``max_consecutive_errors`` bad samples in a row."""

    on_error: str = "raise"
    max_consecutive_errors: int = 10

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise InputError(f"ErrorPolicy.on_error={self.on_error!r} is not one of {', '.join(ON_ERROR)}")
        _at_least("ErrorPolicy.max_consecutive_errors", self.max_consecutive_errors, 1)


@dataclass(frozen=True)
class Sampling:
    """The order samples come in. ``shuffle=False`` reads shards and samples in manifest order (evaluation);
    otherwise a seeded shard shuffle and a shuffle buffer of ``shuffle_buffer`` samples (0: none). Optional class
    weighting: ``class_weights="balanced"`` or one weight per class; each epoch is then as many draws, each sample
    drawn in proportion to its class's weight (a sample may come several times), the same draws whatever the
    loader and its number of workers (``shards.order.weights``; image datasets need their column index, which
    ``pack-shards`` writes). ``balance`` evens out the ranks' shares of an epoch: ``"pad"`` repeats a few samples
    so every rank gets as many as the largest share, ``"drop"`` leaves out the remainder (logged) so none repeats.

    ``feature_window`` (feature shards, the in-process loader of ``make_loader(mode=InProcess())``): 0 (default)
    permutes a rank's rows of an epoch whole, so every batch may read every shard and a cold first epoch waits
    for all of them at its first batch; ``n > 0`` permutes them within consecutive windows of ``n`` rows of the
    epoch's shuffled shard order and loads the next window's shards on a background thread while the current
    window trains. Set it when the feature table is read cold (larger than memory, remote, or a first epoch),
    to a few shards' worth of rows; mixing is then across shards of one window, over a new shard order every
    epoch. A saved state resumes with the same value only."""

    shuffle: bool = True
    shuffle_buffer: int = 512
    class_weights: str | tuple[float, ...] | None = None
    balance: str = "pad"
    feature_window: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.shuffle, bool):
            raise InputError(f"Sampling.shuffle={self.shuffle!r} must be True or False")
        if self.balance not in BALANCE:
            raise InputError(f"Sampling.balance={self.balance!r} is not one of {', '.join(BALANCE)}")
        _at_least("Sampling.shuffle_buffer", self.shuffle_buffer, 0)
        _at_least("Sampling.feature_window", self.feature_window, 0)
        weights = self.class_weights
        if isinstance(weights, str):
            if weights != "balanced":
                raise InputError(f"Sampling.class_weights={weights!r}: give 'balanced' or one weight per class")
            return
        if weights is None:
            return
        try:
            numbers = tuple(float(w) for w in weights)
        except (TypeError, ValueError):
            raise InputError(f"Sampling.class_weights={weights!r}: give 'balanced' or one weight per class") from None
        if min(numbers, default=0) < 0 or not any(numbers):
            raise InputError(f"Sampling.class_weights={numbers}: must be non-negative and not all zero")
        object.__setattr__(self, "class_weights", numbers)  # a list becomes a tuple: frozen and hashable


@dataclass(frozen=True)
class Decode:
    """How image shards become samples. ``mode`` is one of ``STREAM_DECODES``; ``draft=True`` (standard pipeline,
    transform given as a preset name or ``TransformSpec``) lets PIL decode JPEGs at reduced size when the transform
    needs far fewer pixels; ``decoder`` replaces decoding and transform altogether (a callable taking a
    ``RawSample``; for a fixed draft size with a custom transform use ``ImageDecoder(transform, draft_size=...)``)."""

    mode: str = DEFAULT_DECODE
    draft: bool = False
    decoder: Callable | None = None

    def __post_init__(self) -> None:
        check_decode(self.mode, field="Decode.mode", where="open_dataset (Decode)")
        if not isinstance(self.draft, bool):
            raise InputError(f"Decode.draft={self.draft!r} must be True or False; for a fixed minimum size pass "
                             "decoder=ImageDecoder(transform, draft_size=(width, height))")
        if self.decoder is not None and not callable(self.decoder):
            raise InputError(f"Decode.decoder={self.decoder!r} is not callable")
        if self.mode == "fast" and (self.draft or self.decoder is not None):
            raise InputError("Decode.mode='fast' chooses its own decoder and draft; drop decoder/draft")
        if self.draft and self.decoder is not None:
            raise InputError("Decode.draft applies to the built-in decoder; a custom decoder drafts itself")

    @property
    def image_only(self) -> bool:
        """Whether these options only make sense for image shards (feature shards refuse them)."""
        return self.draft or self.decoder is not None


@dataclass(frozen=True)
class Remote:
    """Where the shards are, when the caller says so. ``base_url`` (a folder, an ``http(s)://`` URL, or a ``pipe:``
    command prefix) replaces the manifest's own folder as the base of its relative shard names; ``url_origins``
    (``"https://host:port"``) are the hosts a manifest may name in absolute shard URLs besides its own. Both come
    only from the caller: a manifest never chooses a command or another host (see ``shards.door.locations``).
    ``storage_options`` configures ``s3://`` access: a mapping of ``shards.transport.s3.S3Options`` fields
    (``{"endpoint_url": ..., "profile": ..., "unsigned": True}``) or an ``S3Options``; credentials are never
    options, they come from the AWS chain. ``shard_cache`` is the storage tier on the node's own disk: whole
    shards fetched once and shared by every rank and worker there (``ShardCache(dir=, limit=, fallback=,
    local=)``; without a folder there is none)."""

    base_url: str | None = None
    url_origins: tuple[str, ...] = ()
    storage_options: Any = None
    shard_cache: ShardCache = ShardCache()

    def __post_init__(self) -> None:
        if self.base_url is not None and not isinstance(self.base_url, str):
            raise InputError(f"Remote.base_url={self.base_url!r} must be a string")
        if not isinstance(self.shard_cache, ShardCache):
            raise InputError(f"Remote.shard_cache={self.shard_cache!r} must be a ShardCache(dir=, limit=, ...)")
        if isinstance(self.url_origins, str):
            raise InputError(f"Remote.url_origins={self.url_origins!r} must be a list of origins, not one string")
        object.__setattr__(self, "url_origins", tuple(str(o) for o in self.url_origins))
        if self.storage_options is not None:
            from shards.transport.s3 import S3Options  # boto3 itself is imported only when a client is made

            object.__setattr__(self, "storage_options", S3Options.from_mapping(self.storage_options))

    @property
    def s3(self) -> Any:
        """The ``S3Options`` in effect (defaults when none were given)."""
        from shards.transport.s3 import S3Options

        return S3Options.from_mapping(self.storage_options)


@dataclass(frozen=True)
class Distributed:
    """Where this process sits in the job. ``rank`` and ``world_size`` (None: from ``torch.distributed`` when a
    process group is up, else rank 0 of 1) choose this rank's share of every epoch. ``nodes`` (None: one node, the
    plain per-epoch shuffle) keeps each shard on one node across epochs, so a node's cache serves its ranks instead
    of missing on a new random share every epoch: set it to the job's node count, ``world_size //
    LOCAL_WORLD_SIZE`` (torchrun; ``SLURM_NNODES`` under Slurm), with ranks numbered node by node, and only when a
    node's cache cannot hold the whole dataset (one that can hits anyway, and a rank then sees every shard over the
    epochs, not only its node's). ``rotate_every=k`` deals the shards to nodes anew every ``k`` epochs (0: never),
    trading one cold epoch per ``k`` for more mixing; see ``shards.order.plan``. A saved state may be resumed on
    another node count (elastic resume), not with another ``rotate_every``. ``StreamConfig`` validates the
    resolved values."""

    rank: int | None = None
    world_size: int | None = None
    nodes: int | None = None
    rotate_every: int = 0


@dataclass(frozen=True)
class MemoryCache:
    """``open_dataset(cache=MemoryCache(...))``: ``cache="memory"`` with its sizes. ``limit``: at most this many
    bytes (``"8G"``; None: half of what the job's cgroup or the machine has left); ``side``: the train preset's
    cached images are bounded to this shorter side (None: ``size / 0.875``). ``shards.cache.images`` validates
    them."""

    limit: int | str | None = None
    side: int | None = None


def _at_least(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name}={value!r} must be an integer >= {minimum}")
