"""The grouped options of ``open_dataset``: small frozen dataclasses, each validated on entry.

``open_dataset`` keeps the everyday options flat (split, transform, seed, shuffle, rank, ...); the rarer ones come
in groups, so a call states only what it changes: ``ErrorPolicy`` (what a corrupt sample does), ``Sampling``
(shuffle buffer and class weighting), ``Decode`` (which image pipeline, PIL draft decoding, a custom decoder) and
``Remote`` (where shards are fetched from when not beside the manifest, which hosts a manifest may name, and how
to reach object storage).
A bad value raises a one-line ``InputError`` naming the group and field. This module imports nothing heavy, so
command-line modules can share ``PIPELINES`` without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from shards.errors import InputError

# The image pipelines, defined once. "standard" yields float tensors normalised in the workers, so any model takes
# them: it is the library default. "fast" yields uint8 tensors that the consumer normalises on its device
# (``dataset.decoder.normalizer()``), so only a caller that does that (train-from-shards) may default to it.
PIPELINES = ("standard", "fast")
DEFAULT_PIPELINE = "standard"
ON_ERROR = ("raise", "skip")


def check_pipeline(pipeline: str, *, field: str = "pipeline") -> str:
    """``pipeline`` if it is one of ``PIPELINES``; the one place a pipeline name is validated."""
    if pipeline not in PIPELINES:
        raise InputError(f"{field}={pipeline!r} is not one of {', '.join(PIPELINES)}")
    return pipeline


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
    """A seeded shuffle buffer of ``shuffle_buffer`` samples (0: none), and optional class weighting:
    ``class_weights="balanced"`` or one weight per class, resampled in windows of ``weight_window`` samples."""

    shuffle_buffer: int = 512
    class_weights: str | tuple[float, ...] | None = None
    weight_window: int = 1024

    def __post_init__(self) -> None:
        _at_least("Sampling.shuffle_buffer", self.shuffle_buffer, 0)
        _at_least("Sampling.weight_window", self.weight_window, 1)
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
    """How image shards become samples. ``pipeline`` is one of ``PIPELINES``; ``draft=True`` (standard pipeline,
    transform given as a preset name or ``TransformSpec``) lets PIL decode JPEGs at reduced size when the transform
    needs far fewer pixels; ``decoder`` replaces decoding and transform altogether (a callable taking a
    ``RawSample``; for a fixed draft size with a custom transform use ``ImageDecoder(transform, draft_size=...)``)."""

    pipeline: str = DEFAULT_PIPELINE
    draft: bool = False
    decoder: Callable | None = None

    def __post_init__(self) -> None:
        check_pipeline(self.pipeline, field="Decode.pipeline")
        if not isinstance(self.draft, bool):
            raise InputError(f"Decode.draft={self.draft!r} must be True or False; for a fixed minimum size pass "
                             "decoder=ImageDecoder(transform, draft_size=(width, height))")
        if self.decoder is not None and not callable(self.decoder):
            raise InputError(f"Decode.decoder={self.decoder!r} is not callable")
        if self.pipeline == "fast" and (self.draft or self.decoder is not None):
            raise InputError("Decode.pipeline='fast' chooses its own decoder and draft; drop decoder/draft")
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
    only from the caller: a manifest never chooses a command or another host (see ``shards.formats.locations``).
    ``storage_options`` configures ``s3://`` access: a mapping of ``shards.formats.s3.S3Options`` fields
    (``{"endpoint_url": ..., "profile": ..., "unsigned": True}``) or an ``S3Options``; credentials are never
    options, they come from the AWS chain. With a node-local shard cache (``open_dataset(cache_dir=...)``),
    ``cache_fallback=True`` reads from the source when the cache disk is full instead of failing, and
    ``cache_local`` decides whether local paths are cached (None: only those on a network file system)."""

    base_url: str | None = None
    url_origins: tuple[str, ...] = ()
    storage_options: Any = None
    cache_fallback: bool = False
    cache_local: bool | None = None

    def __post_init__(self) -> None:
        if self.base_url is not None and not isinstance(self.base_url, str):
            raise InputError(f"Remote.base_url={self.base_url!r} must be a string")
        if isinstance(self.url_origins, str):
            raise InputError(f"Remote.url_origins={self.url_origins!r} must be a list of origins, not one string")
        object.__setattr__(self, "url_origins", tuple(str(o) for o in self.url_origins))
        if self.storage_options is not None:
            from shards.formats.s3 import S3Options  # boto3 itself is imported only when a client is made

            object.__setattr__(self, "storage_options", S3Options.from_mapping(self.storage_options))

    @property
    def s3(self) -> Any:
        """The ``S3Options`` in effect (defaults when none were given)."""
        from shards.formats.s3 import S3Options

        return S3Options.from_mapping(self.storage_options)


def _at_least(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InputError(f"{name}={value!r} must be an integer >= {minimum}")
