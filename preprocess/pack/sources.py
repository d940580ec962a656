"""Scanning a source (ImageFolder tree, train/val/test trees, CSV or JSONL list) into labelled source samples.

Scanning only lists and stats files: nothing is decoded and nothing is written, so every input error is found
before the first byte of output exists. Each sample gets a key derived from its relative path alone, so the same
file gets the same key on every machine and every rerun.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple

from shards.errors import InputError, MissingInputError
from shards.formats.sample import IMAGE_EXTENSIONS

log = logging.getLogger("shardcache.sources")

SPLIT_DIRS = ("train", "val", "test")
LIST_COLUMNS = ("path", "label", "split")
SPLIT_NAME = re.compile(r"^[A-Za-z0-9_]+$")
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


@dataclass(frozen=True)
class SourceScan:
    kind: str  # "imagefolder", "imagefolder-splits", "csv", "jsonl"
    root: str
    classes: tuple[str, ...]
    samples: tuple[SourceSample, ...]

    @property
    def files_seen(self) -> int:
        return len(self.samples)

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


def _stat_sample(path: Path, rel_path: str, label: int, split: str | None) -> SourceSample:
    try:
        stat = path.stat()
    except OSError as exc:
        raise MissingInputError(f"cannot stat ({exc.strerror or exc})", path=str(path)) from exc
    return SourceSample(sample_key(rel_path), rel_path, str(path), label, split, stat.st_size, stat.st_mtime_ns)


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
    samples = []
    for split, files in per_split.items():
        for name, paths in files.items():
            for path in paths:
                rel_path = path.relative_to(root).as_posix()
                samples.append(_stat_sample(path, rel_path, class_to_idx[name], split))
    samples.sort(key=lambda s: s.rel_path)
    if not samples:
        raise InputError("holds no image files", path=str(root))
    return SourceScan(kind, str(root), classes, tuple(samples))


def scan_image_folder(root: Path, *, allow_empty_classes: bool = False) -> SourceScan:
    """``root/<class>/...`` or ``root/{train,val[,test]}/<class>/...`` (kept as splits)."""
    subdirs = {p.name for p in _visible_dirs(root)}
    if "train" in subdirs and subdirs <= set(SPLIT_DIRS):
        per_split = {split: _scan_class_dirs(root / split, allow_empty_classes)
                     for split in SPLIT_DIRS if split in subdirs}
        return _folder_samples(root, per_split, "imagefolder-splits")
    return _folder_samples(root, {None: _scan_class_dirs(root, allow_empty_classes)}, "imagefolder")


def _list_rows_csv(path: Path) -> Iterable[tuple[int, dict[str, str]]]:
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise InputError("empty list file (expected a header row path,label[,split])", path=str(path))
        header = [h.strip() for h in header]
        _check_columns(header, path, 1)
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise InputError(f"line {reader.line_num}: {len(row)} fields, header has {len(header)}",
                                 path=str(path))
            yield reader.line_num, dict(zip(header, (cell.strip() for cell in row)))


def _list_rows_jsonl(path: Path) -> Iterable[tuple[int, dict[str, str]]]:
    with open(path, encoding="utf-8") as handle:
        for line_num, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"line {line_num}: not valid JSON ({exc.msg})", path=str(path)) from None
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
        if not file_path.is_file():
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
    samples = tuple(_stat_sample(p, rel, class_to_idx[label], split) for rel, p, label, split in entries)
    return SourceScan(kind, str(path.resolve()), classes, samples)


def _relative_name(file_path: Path, base: Path) -> str:
    resolved = file_path.absolute()
    try:
        return resolved.relative_to(base).as_posix()
    except ValueError:
        return resolved.as_posix()


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
