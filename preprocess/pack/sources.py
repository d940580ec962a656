"""Scanning a source (ImageFolder tree, train/val/test trees, CSV or JSONL list) into labelled source samples.

Scanning only lists and stats files: nothing is decoded and nothing is written, so every input error is found
before the first byte of output exists. Each sample gets a key derived from its relative path alone, so the same
file gets the same key on every machine and every rerun.

Only regular files are packed (symlinks to them are followed). A FIFO, socket or device named like an image, a
dangling symlink or a symlink loop is not an error of the whole source but a skipped file: it lands in
``SourceScan.skipped`` with its reason (and in ``dataset.json``'s ``source.skipped``); ``--strict`` makes it fatal.
The packer checks again when it opens the file (``validate.read_file``), since a file can be swapped after the scan.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple

from preprocess.pack.csv_records import SPLIT_NAME, read_csv_records
from shards.bounded_read import not_regular_reason, read_regular_file
from shards.errors import InputError, MissingInputError
from shards.jsonlines import json_lines
from shards.formats.sample import IMAGE_EXTENSIONS

log = logging.getLogger("shardcache.sources")

SPLIT_DIRS = ("train", "val", "test")
LIST_COLUMNS = ("path", "label", "split")
KEY_SLUG_CHARS = 64
KEY_HASH_CHARS = 12
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class SourceSample(NamedTuple):
    """One source file to pack. ``rel_path`` (POSIX, relative to the source root) is its identity."""

    key: str
    rel_path: str
    abs_path: str
    label: int
    split: str | None  # None: the source has no split; the packer assigns one
    size: int
    mtime_ns: int


class SkippedSource(NamedTuple):
    """A file found in the source that cannot be packed (not a regular file, a broken link), and why."""

    rel_path: str
    reason: str


@dataclass(frozen=True)
class SourceScan:
    kind: str  # "imagefolder", "imagefolder-splits", "csv", "jsonl"
    root: str
    classes: tuple[str, ...]
    samples: tuple[SourceSample, ...]
    skipped: tuple[SkippedSource, ...] = ()

    @property
    def files_seen(self) -> int:
        return len(self.samples) + len(self.skipped)

    @property
    def has_splits(self) -> bool:
        return any(s.split is not None for s in self.samples)


def sample_key(rel_path: str) -> str:
    """A tar-safe key: an ASCII slug of the path (no dots, since webdataset splits the key at the first dot)
    plus a hash of the full path, so two classes holding ``img.jpg`` never collide."""
    slug = _UNSAFE.sub("_", rel_path).strip("_")[-KEY_SLUG_CHARS:].lstrip("_") or "sample"
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:KEY_HASH_CHARS]
    return f"{slug}-{digest}"


def is_image_name(name: str) -> bool:
    return not name.startswith(".") and name.rpartition(".")[2].lower() in IMAGE_EXTENSIONS and "." in name


def _stat_sample(path: Path, rel_path: str, label: int, split: str | None) -> SourceSample | SkippedSource:
    """The sample, or why it is skipped. Never opens the file: opening a FIFO would block."""
    try:
        info = path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return SkippedSource(rel_path, "symbolic link loop")
        if isinstance(exc, FileNotFoundError) and path.is_symlink():
            return SkippedSource(rel_path, f"dangling symbolic link (to {os.readlink(path)!r})")
        return SkippedSource(rel_path, f"cannot stat ({exc.strerror or exc})")
    reason = not_regular_reason(info.st_mode)
    if reason is not None:
        return SkippedSource(rel_path, reason)
    return SourceSample(sample_key(rel_path), rel_path, str(path), label, split, info.st_size, info.st_mtime_ns)


def _make_scan(kind: str, root: str, classes: tuple[str, ...],
               found: list[SourceSample | SkippedSource]) -> SourceScan:
    samples = [s for s in found if isinstance(s, SourceSample)]
    skipped = sorted((s for s in found if isinstance(s, SkippedSource)), key=lambda s: s.rel_path)
    for item in skipped:  # the packer's one warning line counts them by reason (preprocess.pack.packer.log_skipped)
        log.debug("%s: skipping %s: %s", root, item.rel_path, item.reason)
    return SourceScan(kind, root, classes, tuple(samples), tuple(skipped))


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


def _image_files(class_dir: Path) -> list[Path]:
    """Every image under ``class_dir``, nested folders included, hidden files and folders skipped."""
    found = []
    for folder, dirnames, filenames in os.walk(class_dir):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.extend(Path(folder) / name for name in filenames if is_image_name(name))
    return found


def _scan_class_dirs(root: Path, allow_empty: bool) -> dict[str, list[Path]]:
    class_dirs = _visible_dirs(root)
    if not class_dirs:
        raise InputError("holds no class folders (expected <root>/<class>/<image files>)", path=str(root))
    files = {d.name: _image_files(d) for d in class_dirs}
    for name, paths in files.items():
        if not paths and not allow_empty:
            raise InputError("class folder holds no images (pass --allow-empty-classes to keep it)",
                             path=str(root / name))
    loose = [p.name for p in root.iterdir() if p.is_file() and is_image_name(p.name)]
    if loose:
        log.warning("%s: ignoring %d image(s) outside any class folder", root, len(loose))
    return files


def _folder_samples(root: Path, per_split: dict[str | None, dict[str, list[Path]]], kind: str) -> SourceScan:
    classes = tuple(sorted({name for files in per_split.values() for name in files}))
    class_to_idx = {name: i for i, name in enumerate(classes)}
    found = []
    for split, files in per_split.items():
        for name, paths in files.items():
            for path in paths:
                rel_path = path.relative_to(root).as_posix()
                found.append(_stat_sample(path, rel_path, class_to_idx[name], split))
    found.sort(key=lambda s: s.rel_path)
    scan = _make_scan(kind, str(root), classes, found)
    if not scan.samples:
        raise InputError("holds no image files" + (f" ({len(scan.skipped)} skipped: {scan.skipped[0].reason})"
                                                   if scan.skipped else ""), path=str(root))
    return scan


def scan_image_folder(root: Path, *, allow_empty_classes: bool = False) -> SourceScan:
    """``root/<class>/...`` or ``root/{train,val[,test]}/<class>/...`` (kept as splits)."""
    subdirs = {p.name for p in _visible_dirs(root)}
    if "train" in subdirs and subdirs <= set(SPLIT_DIRS):
        per_split = {split: _scan_class_dirs(root / split, allow_empty_classes)
                     for split in SPLIT_DIRS if split in subdirs}
        return _folder_samples(root, per_split, "imagefolder-splits")
    return _folder_samples(root, {None: _scan_class_dirs(root, allow_empty_classes)}, "imagefolder")


def _list_rows_csv(path: Path) -> Iterable[tuple[int, dict[str, str]]]:
    header, records = read_csv_records(path, "path,label[,split]")
    _check_columns(header, path, 1)
    for line_num, cells in records:
        yield line_num, dict(zip(header, cells))


def _list_rows_jsonl(path: Path) -> Iterable[tuple[int, dict[str, str]]]:
    try:
        text = read_regular_file(path).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", path=str(path)) from None
    for line_num, row, bad in json_lines(text):
        if bad is not None:
            raise InputError(f"line {line_num}: not valid JSON ({bad})", path=str(path))
        if not isinstance(row, dict):
            raise InputError(f"line {line_num}: expected a JSON object", path=str(path))
        _check_columns(list(row), path, line_num)
        yield line_num, {k: "" if v is None else str(v).strip() for k, v in row.items()}


def _check_columns(columns: list[str], path: Path, line_num: int) -> None:
    unknown = [c for c in columns if c not in LIST_COLUMNS]
    if unknown:
        raise InputError(f"line {line_num}: unknown column {unknown[0]!r} (allowed: {', '.join(LIST_COLUMNS)})",
                         path=str(path))
    for required in ("path", "label"):
        if required not in columns:
            raise InputError(f"line {line_num}: missing column {required!r}", path=str(path))


def scan_list_file(path: Path) -> SourceScan:
    """A CSV or JSONL list of ``path,label[,split]``; relative paths are relative to the list's folder."""
    kind = "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "csv"
    rows = _list_rows_jsonl(path) if kind == "jsonl" else _list_rows_csv(path)
    base = path.parent.resolve()
    entries: list[tuple[str, Path, str, str | None]] = []
    seen: dict[str, int] = {}
    for line_num, row in rows:
        where = f"line {line_num}"
        if not row.get("path"):
            raise InputError(f"{where}: empty path", path=str(path))
        if not row.get("label"):
            raise InputError(f"{where}: empty label", path=str(path))
        split = row.get("split") if "split" in row else None
        if split is not None and not SPLIT_NAME.match(split):
            raise InputError(f"{where}: split {split!r} is not a plain name (letters, digits, _)", path=str(path))
        file_path = Path(row["path"]) if Path(row["path"]).is_absolute() else base / row["path"]
        if not os.path.lexists(file_path):  # a dangling link is a skipped file, a missing one a typo in the list
            raise MissingInputError(f"{where}: no such file {row['path']!r}", path=str(path))
        rel_path = _relative_name(file_path, base)
        if rel_path in seen:
            raise InputError(f"{where}: {row['path']!r} is listed twice (first on line {seen[rel_path]})",
                             path=str(path))
        seen[rel_path] = line_num
        entries.append((rel_path, file_path, row["label"], split))
    if not entries:
        raise InputError("lists no files", path=str(path))
    if len({split is None for _, _, _, split in entries}) > 1:
        raise InputError("some rows have a split and some do not", path=str(path))
    classes = tuple(sorted({label for _, _, label, _ in entries}))
    class_to_idx = {name: i for i, name in enumerate(classes)}
    found = [_stat_sample(p, rel, class_to_idx[label], split) for rel, p, label, split in entries]
    scan = _make_scan(kind, str(path.resolve()), classes, found)
    if not scan.samples:
        raise InputError(f"lists no packable files ({len(scan.skipped)} skipped: {scan.skipped[0].reason})",
                         path=str(path))
    return scan


def _relative_name(file_path: Path, base: Path) -> str:
    resolved = file_path.absolute()
    try:
        return resolved.relative_to(base).as_posix()
    except ValueError:
        return resolved.as_posix()


def check_out_outside_source(source: str | os.PathLike, out: str | os.PathLike) -> None:
    """Refuse an output folder that a folder source's scan would walk (the source itself or a visible folder in
    it): its shards would be packed once, then every rerun would find the output as one more class (or split).
    Hidden folders are never scanned, so ``SOURCE/.shards`` is allowed; list files name their images, so they scan
    no folder."""
    if not Path(source).is_dir():
        return
    root, target = os.path.realpath(source), os.path.realpath(out)
    if os.path.commonpath([root, target]) != root:
        return
    inside = Path(os.path.relpath(target, root)).parts
    if not any(part.startswith(".") and part != "." for part in inside):
        where = "is the source folder" if inside == (".",) else f"is inside the source folder {source}"
        raise InputError(f"--out {where}, where the next scan would take it for a class; choose a folder outside "
                         "the source", path=str(out))


def scan_source(source: str | os.PathLike, *, allow_empty_classes: bool = False) -> SourceScan:
    """Dispatch on what ``source`` is: a folder tree or a ``.csv``/``.jsonl`` list file."""
    path = Path(source)
    if not path.exists():
        raise MissingInputError("no such file or folder", path=str(path))
    if path.is_dir():
        return scan_image_folder(path.absolute(), allow_empty_classes=allow_empty_classes)
    if path.suffix.lower() in (".csv", ".jsonl", ".ndjson"):
        return scan_list_file(path)
    raise InputError("not a folder, .csv or .jsonl file", path=str(path))
