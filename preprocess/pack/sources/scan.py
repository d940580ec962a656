"""Scanning a source (ImageFolder tree, train/val/test trees, CSV or JSONL list; or a container source: Parquet,
``datasets.save_to_disk`` Arrow, WebDataset tars) into labelled source samples.

Container sources are scanned by their own modules (``preprocess.pack.sources.parquet``, ``source_tars``): there
a sample is a member of a file (``preprocess.pack.sources.members``), and what follows about files applies to the
containers themselves.

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
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, NamedTuple

from preprocess.pack.sources.columns import NO_SPLIT, SamplesBuilder, SourceSample, SourceSamples, as_samples, sample_key
from preprocess.pack.sources.csv_records import SPLIT_NAME, iter_csv_records
from preprocess.pack.sources.members import DEFAULT_MAX_BYTES, MemberSpec, SourceFields
from preprocess.pack.sources.parquet import scan_table_source, table_source_kind
from preprocess.pack.sources.tars import is_tar_pattern, scan_tar_source
from shards.door.bounded_read import not_regular_reason, read_regular_file
from shards.errors import InputError, MissingInputError
from shards.door.jsonlines import json_lines
from shards.formats.sample import IMAGE_EXTENSIONS
from shards.door.shape import as_str

log = logging.getLogger("shardcache.sources")

SPLIT_DIRS = ("train", "val", "test")
KEPT_KEY_KINDS = ("webdataset",)  # sources whose samples keep their own keys (checked by the scan)
LIST_COLUMNS = ("path", "label", "split")
__all__ = ["SourceSample", "SourceScan", "SkippedSource", "sample_key", "scan_source", "check_out_outside_source"]


class SkippedSource(NamedTuple):
    """A file found in the source that cannot be packed (not a regular file, a broken link), and why."""

    rel_path: str
    reason: str


def scan_base(kind: str, root: str) -> str:
    """The folder relative paths are relative to: the tree itself, or a list file's folder."""
    return root if kind.startswith("imagefolder") else os.path.dirname(root)


@dataclass(frozen=True)
class SourceScan:
    """``samples`` is a ``SourceSamples`` (columns); rows given as ``SourceSample`` tuples are stored as columns."""

    kind: str  # "imagefolder", "imagefolder-splits", "csv", "jsonl", "parquet", "hf-arrow", "webdataset"
    root: str
    classes: tuple[str, ...]
    samples: SourceSamples
    skipped: tuple[SkippedSource, ...] = ()
    members: MemberSpec | None = None  # how to read members of container files; None: each sample is a file

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", as_samples(self.samples, scan_base(self.kind, self.root),
                                                       kept_keys=self.kind in KEPT_KEY_KINDS))

    @property
    def files_seen(self) -> int:
        return len(self.samples) + len(self.skipped)

    @property
    def has_splits(self) -> bool:
        return bool((self.samples.column("split") != NO_SPLIT).any())


def is_image_name(name: str) -> bool:
    return not name.startswith(".") and name.rpartition(".")[2].lower() in IMAGE_EXTENSIONS and "." in name


def _stat_file(abs_path: str, rel_path: str) -> os.stat_result | SkippedSource:
    """The file's stat, or why it is skipped. Never opens the file: opening a FIFO would block."""
    try:
        info = os.stat(abs_path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return SkippedSource(rel_path, "symbolic link loop")
        if isinstance(exc, FileNotFoundError) and os.path.islink(abs_path):
            return SkippedSource(rel_path, f"dangling symbolic link (to {os.readlink(abs_path)!r})")
        return SkippedSource(rel_path, f"cannot stat ({exc.strerror or exc})")
    reason = not_regular_reason(info.st_mode)
    return info if reason is None else SkippedSource(rel_path, reason)


def _add_file(builder: SamplesBuilder, skipped: list[SkippedSource], rel_path: str, label: int,
              split: str | None) -> None:
    info = _stat_file(os.path.join(builder.base, rel_path), rel_path)
    if isinstance(info, SkippedSource):
        skipped.append(info)
    else:
        builder.add(rel_path, label, split, info.st_size, info.st_mtime_ns)


def _make_scan(kind: str, root: str, classes: tuple[str, ...], builder: SamplesBuilder,
               skipped: list[SkippedSource]) -> SourceScan:
    skipped.sort(key=lambda s: s.rel_path)
    for item in skipped:  # the packer's one warning line counts them by reason (preprocess.pack.packer.log_skipped)
        log.debug("%s: skipping %s: %s", root, item.rel_path, item.reason)
    return SourceScan(kind, root, classes, builder.build(), tuple(skipped))


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


def _image_files(class_dir: str, class_rel: str) -> list[str]:
    """The relative path of every image under ``class_dir`` (nested folders included, hidden files and folders
    skipped), sorted: one class at a time, so only one class's names are ever held as strings."""
    found = []
    for folder, dirnames, filenames in os.walk(class_dir):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        prefix = class_rel + folder[len(class_dir):] + "/"
        found.extend(prefix + name for name in filenames if is_image_name(name))
    found.sort()
    return found


def _class_dirs(root: Path) -> list[str]:
    class_dirs = [p.name for p in _visible_dirs(root)]
    if not class_dirs:
        raise InputError("holds no class folders (expected <root>/<class>/<image files>)", path=str(root))
    loose = [p.name for p in root.iterdir() if p.is_file() and is_image_name(p.name)]
    if loose:
        log.warning("%s: ignoring %d image(s) outside any class folder", root, len(loose))
    return class_dirs


def _folder_samples(root: Path, per_split: dict[str | None, list[str]], kind: str,
                    allow_empty: bool) -> SourceScan:
    """Every class folder of every split, stat'ed into columns in relative-path order. The files of one class
    folder are a contiguous run of that order (every path in it starts with the folder's path and a slash), so
    sorting the folders by that prefix and each folder's files gives the sorted whole without holding it."""
    classes = tuple(sorted({name for names in per_split.values() for name in names}))
    class_to_idx = {name: i for i, name in enumerate(classes)}
    folders = sorted(((f"{split}/{name}" if split else name), split, name)
                     for split, names in per_split.items() for name in names)
    builder, skipped = SamplesBuilder(str(root), [s for s in SPLIT_DIRS if s in per_split]), []
    for class_rel, split, name in sorted(folders, key=lambda f: f[0] + "/"):
        rel_paths = _image_files(os.path.join(str(root), class_rel), class_rel)
        if not rel_paths and not allow_empty:
            raise InputError("class folder holds no images (pass --allow-empty-classes to keep it)",
                             path=str(root / class_rel))
        for rel_path in rel_paths:
            _add_file(builder, skipped, rel_path, class_to_idx[name], split)
    scan = _make_scan(kind, str(root), classes, builder, skipped)
    if not len(scan.samples):
        raise InputError("holds no image files" + (f" ({len(scan.skipped)} skipped: {scan.skipped[0].reason})"
                                                   if scan.skipped else ""), path=str(root))
    return scan


def scan_image_folder(root: Path, *, allow_empty_classes: bool = False) -> SourceScan:
    """``root/<class>/...`` or ``root/{train,val[,test]}/<class>/...`` (kept as splits)."""
    subdirs = {p.name for p in _visible_dirs(root)}
    if "train" in subdirs and subdirs <= set(SPLIT_DIRS):
        per_split = {split: _class_dirs(root / split) for split in SPLIT_DIRS if split in subdirs}
        return _folder_samples(root, per_split, "imagefolder-splits", allow_empty_classes)
    return _folder_samples(root, {None: _class_dirs(root)}, "imagefolder", allow_empty_classes)


def _list_rows_csv(path: Path) -> Iterable[tuple[int, dict[str, str]]]:
    header, records = iter_csv_records(path, "path,label[,split]")
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
        yield line_num, {name: _list_cell(value, name, line_num, path) for name, value in row.items()}


def _list_cell(value: object, name: str, line_num: int, path: Path) -> str:
    """A JSONL list's cell as text: a string (stripped), null (empty), or for a label an integer (``3`` names
    class "3", as a CSV cell would). Anything else is refused, not turned into text: ``str()`` would make a list,
    an object, ``true`` or ``NaN`` a class name or a path silently."""
    if value is None:
        return ""
    if name == "label" and type(value) is int:
        return str(value)
    return as_str(value, f"line {line_num}: {name}", where=str(path), error=InputError).strip()


def _check_columns(columns: list[str], path: Path, line_num: int) -> None:
    unknown = [c for c in columns if c not in LIST_COLUMNS]
    if unknown:
        raise InputError(f"line {line_num}: unknown column {unknown[0]!r} (allowed: {', '.join(LIST_COLUMNS)})",
                         path=str(path))
    for required in ("path", "label"):
        if required not in columns:
            raise InputError(f"line {line_num}: missing column {required!r}", path=str(path))


def scan_list_file(path: Path) -> SourceScan:
    """A CSV or JSONL list of ``path,label[,split]``; relative paths are relative to the list's folder.

    Rows are checked and stat'ed as they are read, into columns: labels are numbered as they are first seen and
    renumbered in sorted order at the end, so no row is held as Python objects (only each path, to refuse one
    listed twice)."""
    kind = "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "csv"
    rows = _list_rows_jsonl(path) if kind == "jsonl" else _list_rows_csv(path)
    base = path.parent.resolve()
    builder, skipped = SamplesBuilder(str(base)), []
    labels: dict[str, int] = {}  # label -> number in order of first appearance
    seen: dict[str, int] = {}
    with_split = set()
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
        with_split.add(split is not None)
        _add_file(builder, skipped, rel_path, labels.setdefault(row["label"], len(labels)), split)
    if not seen:
        raise InputError("lists no files", path=str(path))
    if len(with_split) > 1:
        raise InputError("some rows have a split and some do not", path=str(path))
    classes = tuple(sorted(labels))
    builder.renumber_labels([classes.index(name) for name in labels])
    scan = _make_scan(kind, str(path.resolve()), classes, builder, skipped)
    if not len(scan.samples):
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


def scan_source(source: str | os.PathLike, *, allow_empty_classes: bool = False,
                fields: SourceFields | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> SourceScan:
    """Dispatch on what ``source`` is: WebDataset tars (a ``.tar`` path or a brace pattern), a Parquet file or
    folder, a ``datasets.save_to_disk`` folder, a folder tree or a ``.csv``/``.jsonl`` list file. ``fields`` (where
    the image and label are) applies to the container sources only; ``max_bytes`` (a shard's, ``--max-bytes``)
    bounds what a container may make a reader decode at once (a sample, a row group), judged from what it
    declares before anything is read."""
    if is_tar_pattern(str(source)):
        pattern = os.path.join(os.getcwd(), source)  # not normalised: ``..`` after a brace must stay
        return _member_scan("webdataset", pattern,
                            scan_tar_source(pattern, fields or SourceFields(), max_bytes=max_bytes))
    path = Path(source)
    if not path.exists():
        raise MissingInputError("no such file or folder", path=str(path))
    kind = table_source_kind(path)
    if kind is not None:
        given = fields or SourceFields()
        if given.label_member is not None or given.label_field is not None:
            raise InputError("--label-member and --label-field apply to WebDataset tars; use --label-column",
                             path=str(path))
        found = scan_table_source(path.absolute(), kind, given.image_column, given.label_column,
                                  max_bytes=max_bytes)
        return _member_scan(kind, str(path.absolute()), found)
    if fields is not None and fields != SourceFields():
        raise InputError("--image-column, --label-column, --label-member and --label-field apply to Parquet, Arrow "
                         "and WebDataset sources, not to image files", path=str(path))
    if path.is_dir():
        return scan_image_folder(path.absolute(), allow_empty_classes=allow_empty_classes)
    if path.suffix.lower() in (".csv", ".jsonl", ".ndjson"):
        return scan_list_file(path)
    raise InputError("not a folder, .csv, .jsonl, .parquet or .tar file", path=str(path))


def _member_scan(kind: str, root: str, found: tuple) -> SourceScan:
    """The scan of a container source from what its scanner found: ``(classes, samples, skipped pairs, spec)``."""
    classes, samples, skipped, spec = found
    scan = SourceScan(kind, root, classes, samples, tuple(sorted(SkippedSource(*s) for s in skipped)), spec)
    for item in scan.skipped:
        log.debug("%s: skipping %s: %s", root, item.rel_path, item.reason)
    if not len(scan.samples):
        raise InputError("holds no packable samples" + (f" ({len(scan.skipped)} skipped: {scan.skipped[0].reason})"
                                                        if scan.skipped else ""), path=root)
    return scan
