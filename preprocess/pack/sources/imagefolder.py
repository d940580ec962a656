"""ImageFolder trees as a packing source: ``root/<class>/...``, or ``root/{train,val[,test]}/<class>/...`` kept
as splits (two kinds, one layout each, so the manifest says which was read).

Each sample gets a key derived from its path relative to the root alone, so the same file gets the same key on
every machine and every rerun. Hidden files and folders are never scanned, images outside any class folder are
ignored with one warning, and a class folder without images is an error unless ``--allow-empty-classes``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from preprocess.pack.sources.columns import SamplesBuilder, is_utf8_name, printable_name
from preprocess.pack.sources.kind import KindScan, ScanRequest, SkippedSource, add_file, found
from shards.errors import InputError
from shards.formats.sample import IMAGE_EXTENSIONS

log = logging.getLogger("shardcache.sources")

SPLIT_DIRS = ("train", "val", "test")


def is_image_name(name: str) -> bool:
    return not name.startswith(".") and name.rpartition(".")[2].lower() in IMAGE_EXTENSIONS and "." in name


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


def is_split_trees(source: str) -> bool:
    """A folder whose visible folders are ``train`` and some of ``val`` and ``test``."""
    root = Path(source)
    if not root.is_dir():
        return False
    subdirs = {p.name for p in _visible_dirs(root)}
    return "train" in subdirs and subdirs <= set(SPLIT_DIRS)


def is_tree(source: str) -> bool:
    """Any folder: its visible folders are its classes (an empty one is refused by the scan, with the reason)."""
    return Path(source).is_dir()


def scan_split_trees(source: str, request: ScanRequest) -> KindScan:
    root = Path(source).absolute()
    subdirs = {p.name for p in _visible_dirs(root)}
    per_split = {split: _class_dirs(root / split) for split in SPLIT_DIRS if split in subdirs}
    return _folder_samples(root, per_split, request)


def scan_tree(source: str, request: ScanRequest) -> KindScan:
    root = Path(source).absolute()
    return _folder_samples(root, {None: _class_dirs(root)}, request)


def _image_files(class_dir: str, class_rel: str) -> list[str]:
    """The relative path of every image under ``class_dir`` (nested folders included, hidden files and folders
    skipped), sorted: one class at a time, so only one class's names are ever held as strings."""
    images = []
    for folder, dirnames, filenames in os.walk(class_dir):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        prefix = class_rel + folder[len(class_dir):] + "/"
        images.extend(prefix + name for name in filenames if is_image_name(name))
    images.sort()
    return images


def _class_dirs(root: Path) -> list[str]:
    class_dirs = [p.name for p in _visible_dirs(root)]
    for name in class_dirs:
        if not is_utf8_name(name):  # a class name is in the manifest: it must be text
            raise InputError("class folder name is not valid UTF-8 (rename it)", path=printable_name(str(root / name)))
    if not class_dirs:
        raise InputError("holds no class folders (expected <root>/<class>/<image files>)", path=str(root))
    loose = [p.name for p in root.iterdir() if p.is_file() and is_image_name(p.name)]
    if loose:
        log.warning("%s: ignoring %d image(s) outside any class folder", root, len(loose))
    return class_dirs


def _folder_samples(root: Path, per_split: dict[str | None, list[str]], request: ScanRequest) -> KindScan:
    """Every class folder of every split, stat'ed into columns in relative-path order. The files of one class
    folder are a contiguous run of that order (every path in it starts with the folder's path and a slash), so
    sorting the folders by that prefix and each folder's files gives the sorted whole without holding it."""
    classes = tuple(sorted({name for names in per_split.values() for name in names}))
    class_to_idx = {name: i for i, name in enumerate(classes)}
    folders = sorted(((f"{split}/{name}" if split else name), split, name)
                     for split, names in per_split.items() for name in names)
    builder = SamplesBuilder(str(root), [s for s in SPLIT_DIRS if s in per_split])
    skipped: list[SkippedSource] = []
    for class_rel, split, name in sorted(folders, key=lambda f: f[0] + "/"):
        rel_paths = _image_files(os.path.join(str(root), class_rel), class_rel)
        if not rel_paths and not request.allow_empty_classes:
            raise InputError("class folder holds no images (pass --allow-empty-classes to keep it)",
                             path=str(root / class_rel))
        for rel_path in rel_paths:
            add_file(builder, skipped, rel_path, class_to_idx[name], split, request.max_bytes)
    scan = found(str(root), classes, builder.build(), skipped)
    if not len(scan.samples):
        raise InputError("holds no image files" + (f" ({len(scan.skipped)} skipped: {scan.skipped[0].reason})"
                                                   if scan.skipped else ""), path=str(root))
    return scan
