"""Checking that a source file is an image worth packing, and optionally re-encoding it to a bounded JPEG.

``header`` reads only the headers (and, for PNG, walks the chunk CRCs without inflating): it catches empty
files, non-images, unknown formats, oversized images and broken PNGs, but not a JPEG or WebP cut short in its
pixel data. ``full`` decodes every pixel, so truncated or corrupt data is found at pack time instead of in the
middle of a training epoch. Sizes are always checked from the header, so an oversized image is never decoded
in full: it is skipped, or (when re-encoding a JPEG) decoded at 1/2, 1/4 or 1/8 scale with ``draft``.

Reading is bounded too (``read_file``): only a regular file is read, opened the one way shardcache opens an
untrusted file (``shards.door.bounded_read.open_regular_file``: ``stat`` first, a non-blocking open checked again on
its descriptor, so a FIFO swapped in after the scan cannot hang the job), and a file whose open and read do not
finish within ``read_timeout_s`` (a hung network mount) is skipped. That read runs in a daemon thread that is
abandoned on timeout: the kernel may keep it blocked, but the job goes on and can exit. The thread is kept
between files (``_ReaderThread``), and a shard's files are read ahead by a thread of their own (``read_ahead``):
a thread started per file, or woken per file, cost more than reading a small image. Every failure is an
``InvalidImage`` whose message is the reason recorded in the skip list.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import threading
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

from PIL import Image, ImageOps

from preprocess.pack.sources.members import DEFAULT_MAX_BYTES, too_large
from shards.door.bounded_read import open_regular_file, read_capped
from shards.image.decode import DEFAULT_MAX_PIXELS, to_rgb
from shards.errors import InputError

VERIFY_MODES = ("header", "full")
READ_TIMEOUT_S = 120.0  # a local or healthy network file opens and reads in far less
READ_AHEAD_FILES = 16  # files read ahead of the one being validated (``read_ahead``)...
READ_AHEAD_BYTES = 64 << 20  # ...and bytes: a shard of large images never buffers more than about this
# The extension a sample is stored under follows its real encoding, not the source file's name.
FORMAT_EXTENSIONS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png", "WEBP": "webp", "BMP": "bmp", "GIF": "gif",
                     "TIFF": "tif"}
ROTATED_ORIENTATIONS = (5, 6, 7, 8)
JPEG_FORMATS = ("JPEG", "MPO")
# Formats whose PIL ``verify()`` checks structure without decoding (PNG walks chunk CRCs); for others it is a no-op.
STRUCTURE_CHECKED = ("PNG",)


class InvalidImage(Exception):
    """The file cannot be packed; the message is the reason recorded in the manifest."""


@dataclass(frozen=True)
class ValidateOptions:
    verify: str = "full"
    max_pixels: int = DEFAULT_MAX_PIXELS
    resize_max_side: int | None = None
    quality: int | None = None
    read_timeout_s: float = READ_TIMEOUT_S  # not recorded in the manifest: it does not change what is stored
    max_file_bytes: int = DEFAULT_MAX_BYTES  # ``--max-bytes``: a larger file is skipped unread (recorded as that)

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise InputError(f"verify={self.verify!r}: choose one of {', '.join(VERIFY_MODES)}")
        if self.max_pixels < 1:
            raise InputError(f"max_pixels={self.max_pixels}: must be at least 1")
        if self.resize_max_side is not None and self.resize_max_side < 1:
            raise InputError(f"resize_max_side={self.resize_max_side}: must be at least 1")
        if self.quality is not None and not 1 <= self.quality <= 100:
            raise InputError(f"quality={self.quality}: must be in 1..100")
        if not self.read_timeout_s > 0:
            raise InputError(f"read_timeout_s={self.read_timeout_s}: must be positive")

    @property
    def reencode(self) -> bool:
        return self.resize_max_side is not None or self.quality is not None


class ValidImage(NamedTuple):
    data: bytes  # what is stored: the source bytes, or the re-encoded JPEG
    ext: str
    width: int  # as displayed (EXIF orientation applied)
    height: int
    mode: str  # the source's PIL mode, e.g. "CMYK" or "I;16"
    format: str  # the source's format, e.g. "PNG"


@contextlib.contextmanager
def _own_pixel_limit() -> Iterator[None]:
    """PIL's bomb check would raise inside ``open``; we check ``--max-pixels`` ourselves from the header."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:200]


def _open(data: bytes) -> Image.Image:
    if not data:
        raise InvalidImage("empty file (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise InvalidImage("not an image (no known image format recognised)") from None
    except Exception as exc:  # PIL raises many types on malformed headers
        raise InvalidImage(f"unreadable image header ({_describe(exc)})") from None
    if image.format not in FORMAT_EXTENSIONS:
        raise InvalidImage(f"unsupported image format {image.format}")
    return image


def _display_size(image: Image.Image) -> tuple[int, int]:
    width, height = image.size
    try:
        orientation = image.getexif().get(0x0112, 1)
    except Exception:  # a broken EXIF block must not reject an otherwise good image
        orientation = 1
    return (height, width) if orientation in ROTATED_ORIENTATIONS else (width, height)


def _check_pixels(image: Image.Image, opts: ValidateOptions) -> None:
    width, height = image.size
    pixels = width * height
    if pixels <= opts.max_pixels:
        return
    if opts.reencode and image.format in JPEG_FORMATS:
        return  # drafted down while decoding; see _reencode
    why = "" if not opts.reencode else " (only JPEG can be downscaled without a full decode)"
    raise InvalidImage(f"too large: {width}x{height} = {pixels} pixels exceeds --max-pixels {opts.max_pixels}{why}")


def _target_size(size: tuple[int, int], max_side: int | None) -> tuple[int, int]:
    width, height = size
    if max_side is None or max(width, height) <= max_side:
        return width, height
    scale = max_side / max(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def _reencode(image: Image.Image, opts: ValidateOptions) -> tuple[bytes, int, int]:
    target = _target_size(image.size, opts.resize_max_side)
    if image.format in JPEG_FORMATS:
        if image.size[0] * image.size[1] > opts.max_pixels:
            # Ask for the smallest DCT scale that still keeps the result within the pixel limit.
            shrink = (image.size[0] * image.size[1] / opts.max_pixels) ** 0.5
            target = (min(target[0], max(1, int(image.size[0] / shrink))),
                      min(target[1], max(1, int(image.size[1] / shrink))))
        image.draft("RGB", target)
        if image.size[0] * image.size[1] > opts.max_pixels:
            raise InvalidImage(f"too large: {image.size[0]}x{image.size[1]} pixels even at 1/8 scale exceeds "
                               f"--max-pixels {opts.max_pixels}")
    image = to_rgb(ImageOps.exif_transpose(image))
    final = _target_size(image.size, opts.resize_max_side)
    if final != image.size:
        image = image.resize(final, Image.Resampling.LANCZOS, reducing_gap=3.0)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=opts.quality or 90)
    return buffer.getvalue(), image.size[0], image.size[1]


def validate_image(data: bytes, opts: ValidateOptions) -> ValidImage:
    """Return what to store for ``data``, or raise ``InvalidImage`` with the reason it must be skipped."""
    with _own_pixel_limit():
        image = _open(data)
        source_format, source_mode = image.format, image.mode
        _check_pixels(image, opts)
        width, height = _display_size(image)
        try:
            if opts.reencode:
                stored, width, height = _reencode(image, opts)
                return ValidImage(stored, "jpg", width, height, source_mode, source_format)
            if opts.verify == "full":
                image.load()
            elif source_format in STRUCTURE_CHECKED:
                # verify() must come straight after open; getexif() above has read on, so start afresh.
                Image.open(io.BytesIO(data)).verify()
        except InvalidImage:
            raise
        except Exception as exc:
            raise InvalidImage(f"truncated or corrupt image data ({_describe(exc)})") from None
    return ValidImage(data, FORMAT_EXTENSIONS[source_format], width, height, source_mode, source_format)


def _read_regular(path: str, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes; ``InvalidImage`` with the reason
    otherwise ("not a regular file (FIFO)", "no such file", "too large: ..."). Never blocks on a FIFO or device;
    a file over the limit (grown since the scan judged it) is refused by its size, and one that grows while read
    is cut at the limit, so memory stays bounded."""
    try:
        with open_regular_file(path) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > limit:
                raise InvalidImage(too_large(size, limit))
            return read_capped(handle, path, limit=limit, error=InputError)
    except InputError as exc:
        raise InvalidImage(exc.reason) from None


class _ReaderThread:
    """The daemon thread that does this process's reads, kept between files: starting a thread per file cost
    more than reading a small image (~0.5 ms against ~0.05 ms). A read that hangs keeps its thread; the caller
    abandons it (``read_file``) and the next read starts a new one. Forked children start their own (``pid``)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="shardcache-read", daemon=True).start()

    def _serve(self) -> None:
        while True:
            path, limit, box, done = self.requests.get()
            try:
                box.append(_read_regular(path, limit))
            except BaseException as exc:  # handed to the caller's thread
                box.append(exc)
            done.release()


class _Lane:
    """A daemon thread reading ``paths`` in order into a bounded buffer (``READ_AHEAD_FILES`` files and
    ``READ_AHEAD_BYTES``, whichever is reached first), so the caller finds each file already read instead of
    waiting for a thread to be scheduled per file (which, on a loaded machine, cost more than the work)."""

    def __init__(self, paths: Sequence[str], limit: int):
        self.limit = limit
        self.cond = threading.Condition()
        self.results: deque[bytes | BaseException] = deque()
        self.buffered = 0
        self.stopped = False
        threading.Thread(target=self._serve, args=(list(paths),), name="shardcache-read-ahead", daemon=True).start()

    def _serve(self, paths: list[str]) -> None:
        for path in paths:
            with self.cond:
                self.cond.wait_for(lambda: self.stopped or (len(self.results) < READ_AHEAD_FILES
                                                            and self.buffered < READ_AHEAD_BYTES))
                if self.stopped:
                    return
            try:
                result: bytes | BaseException = _read_regular(path, self.limit)
            except BaseException as exc:  # handed to the caller's thread
                result = exc
            with self.cond:
                self.results.append(result)
                self.buffered += len(result) if isinstance(result, bytes) else 0
                self.cond.notify_all()

    def take(self, timeout_s: float) -> bytes | BaseException | None:
        """The next file's bytes or failure; None when it is not read within ``timeout_s`` seconds."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.results, timeout_s):
                return None
            result = self.results.popleft()
            self.buffered -= len(result) if isinstance(result, bytes) else 0
            self.cond.notify_all()
            return result

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


class _ReadAhead:
    """The files one shard will read, in order: ``read_file`` takes them from a ``_Lane``; a file not read in
    time abandons that lane (its thread is stuck in the read) and a new one starts after it."""

    def __init__(self, paths: Sequence[str], limit: int):
        self.paths, self.limit = list(paths), limit
        self.next = 0
        self.lane = _Lane(self.paths, limit)

    def expects(self, path: str) -> bool:
        return self.next < len(self.paths) and self.paths[self.next] == path

    def take(self, timeout_s: float) -> bytes | BaseException | None:
        self.next += 1
        result = self.lane.take(timeout_s)
        if result is None:
            self.lane.stop()
            self.lane = _Lane(self.paths[self.next:], self.limit)
        return result

    def close(self) -> None:
        self.lane.stop()


_reader: _ReaderThread | None = None
_reader_guard = threading.Lock()  # one read at a time per process: a hung read is then never another caller's
_ahead = threading.local()  # .plan: the _ReadAhead of the calling thread, inside read_ahead()


@contextlib.contextmanager
def read_ahead(paths: Sequence[str], limit: int = DEFAULT_MAX_BYTES) -> Iterator[None]:
    """Inside, ``read_file`` of ``paths`` in this order (a shard's files) takes each from a thread that reads
    ahead, each file at most ``limit`` bytes; any other path is read as outside. The timeout still bounds the
    wait for every file."""
    plan = _ReadAhead(paths, limit)
    _ahead.plan = plan
    try:
        yield
    finally:
        _ahead.plan = None
        plan.close()


def read_file(path: str, timeout_s: float = READ_TIMEOUT_S, limit: int = DEFAULT_MAX_BYTES) -> bytes:
    """Read a regular file of at most ``limit`` bytes within ``timeout_s`` seconds, else ``InvalidImage`` with the
    reason to record."""
    plan = getattr(_ahead, "plan", None)
    result = plan.take(timeout_s) if plan is not None and plan.expects(path) else _read_alone(path, timeout_s, limit)
    if result is None:
        raise InvalidImage(f"could not be opened and read within {timeout_s:g} s (hung file system?)")
    if isinstance(result, bytes):
        return result
    if isinstance(result, InvalidImage):
        raise result
    if isinstance(result, OSError):  # the read itself failed (an I/O error mid-file)
        raise InvalidImage(f"cannot read ({result.strerror or _describe(result)})") from None
    raise result


def _read_alone(path: str, timeout_s: float, limit: int) -> bytes | BaseException | None:
    """One file read by this process's ``_ReaderThread``; None when not read within ``timeout_s``."""
    global _reader
    box: list[bytes | BaseException] = []
    done = threading.Lock()
    done.acquire()
    with _reader_guard:
        if _reader is None or _reader.pid != os.getpid():
            _reader = _ReaderThread()
        _reader.requests.put((path, limit, box, done))
        if not done.acquire(timeout=timeout_s):
            _reader = None  # its thread is stuck in this read: abandoned, the next read gets a new one
            return None
    return box[0]


def read_and_validate(path: str, opts: ValidateOptions) -> ValidImage:
    """Read one file and validate it; unreadable, non-regular and hung files are skipped like corrupt ones."""
    return validate_image(read_file(path, opts.read_timeout_s, opts.max_file_bytes), opts)


def sample_meta(rel_path: str, class_name: str, image: ValidImage,
                extra: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], bytes]:
    """The ``<key>.json`` member's fields and bytes (sorted keys, so equal inputs give equal bytes). Its values
    are strings and ints (and, from ``extra``: a Parquet row's scalar cells, finite floats, booleans and nulls),
    which JSON gives back unchanged: the fields are what parsing the bytes would return. The packer's own fields
    win over an ``extra`` field of the same name."""
    meta = {**(extra or {}), "path": rel_path, "class": class_name, "width": image.width, "height": image.height,
            "mode": image.mode, "format": image.format}
    return meta, json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")
