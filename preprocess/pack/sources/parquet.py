"""Parquet files and ``datasets.save_to_disk`` folders as a packing source: rows scanned into members, image
cells read back by the packer.

Two kinds, one container format each, recognised from the files alone: a folder with ``dataset_dict.json`` (a
``DatasetDict``: one subfolder per split) or ``state.json`` (one ``Dataset``) is what ``save_to_disk`` writes
(``is_save_to_disk``), its ``data-*.arrow`` files Arrow IPC streams; a ``.parquet`` file, or a folder with
``.parquet`` files at its top or in ``data/`` (the Hub layout, ``data/<split>-NNNNN-of-NNNNN.parquet``), is Parquet
(``is_parquet``: every ``.parquet`` file under the folder, sorted). The registry tries the first before the second.

Each row is a member ``<file>#<row>`` (``preprocess.pack.sources.members``), so its key is derived from the file's
relative name and the row number and stays the same on every rerun. The scan reads only the image, label and split
columns, a row group at a time, to learn each image's size and refuse bad rows before anything is written; the
packer reads the image cells back with the metadata columns. Labels are class names: the ``ClassLabel`` names in the
file's Hugging Face metadata when present (integer labels index them, string labels must be one of them, and a name
listed twice is an error, not a merge), otherwise the distinct values; either way sorted, as every manifest's
classes are, with labels mapped by name.

Every file here is untrusted (docs/trust-model.md, "One door"): the JSON files of a ``save_to_disk`` folder and the
``huggingface`` schema metadata are parsed with a depth bound and checked field by field (``shards.door.shape``),
and the table files are read through ``TableFile`` (``preprocess.pack.sources.arrow_files``), which bounds each row
group by ``--max-bytes`` and validates it; what is computed on its cells runs inside ``arrow_guard``.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator, Sequence

from preprocess.pack.sources.arrow_files import (TableFile, arrow_guard, cell_sizes, check_label_type, check_split_type,
                                                 column_error, image_cell_kind, image_cells, is_scalar,
                                                 json_scalar, missing_image_reason, pyarrow)
from preprocess.pack.sources.csv_records import SPLIT_NAME, SPLIT_NAME_RULE
from preprocess.pack.sources.kind import MAX_CLASS_CHARS, KindScan, ScanRequest, member_scan
from preprocess.pack.sources.members import DEFAULT_MAX_BYTES, RESERVED_META, MemberBytes, MemberSpec, member_path
from preprocess.pack.sources.columns import SamplesBuilder, SourceSample
from shards.door.bounded_read import JSONError, parse_json, read_json_file
from shards.errors import InputError, ManifestError
from shards.door.shape import as_list, as_object, as_str, field

log = logging.getLogger("shardcache.sources")

SPLIT_COLUMN = "split"
HUB_FILE = re.compile(r"^(?P<split>[A-Za-z0-9_]+?)-\d+-of-\d+(?:-[0-9a-f]+)?\.parquet\Z")
SPLIT_ALIASES = {"validation": "val"}  # the Hub's name for what every shardcache stage calls val
NO_LABEL = "no label"
HF_METADATA = "schema metadata 'huggingface'"


def is_save_to_disk(source: str) -> bool:
    path = Path(source)
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def is_parquet(source: str) -> bool:
    path = Path(source)
    if not path.is_dir():  # a file, or something else named like one (refused when opened)
        return path.suffix.lower() == ".parquet" and path.exists()
    return any(p.suffix.lower() == ".parquet" for p in path.iterdir()) or (
        (path / "data").is_dir() and any((path / "data").rglob("*.parquet")))


def scan_parquet(source: str, request: ScanRequest) -> KindScan:
    return _scan(source, "parquet", request)


def scan_save_to_disk(source: str, request: ScanRequest) -> KindScan:
    return _scan(source, "arrow", request)


def _scan(source: str, container: str, request: ScanRequest) -> KindScan:
    root = Path(source).absolute()
    fields = request.fields
    return member_scan(str(root), scan_table_source(root, container, fields.image_column, fields.label_column,
                                                    max_bytes=request.max_bytes))


def _split_name(raw: str) -> str:
    return SPLIT_ALIASES.get(raw, raw)


def _table_files(root: Path, container: str) -> list[tuple[str, str, str | None]]:
    """``(absolute path, path relative to the source's base, split from the layout or None)`` of every file: the
    ``.parquet`` files of a file or folder, or the ``data-*.arrow`` files of a ``save_to_disk`` folder."""
    if container == "parquet":
        if not root.is_dir():
            return [(str(root), root.name, _hub_split(root.name))]
        found = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.parquet")
                       if not any(part.startswith(".") for part in p.relative_to(root).parts))
        return [(str(root / rel), rel, _hub_split(rel.rpartition("/")[2])) for rel in found]
    if (root / "dataset_dict.json").is_file():
        return [(str(root / s / name), f"{s}/{name}", _split_name(s))
                for s in _dataset_dict_splits(root / "dataset_dict.json") for name in _arrow_names(root / s)]
    return [(str(root / name), name, None) for name in _arrow_names(root)]


def _dataset_dict_splits(path: Path) -> list[str]:
    """The splits ``dataset_dict.json`` lists: plain names, so also folder names inside the dataset."""
    where = str(path)
    data = as_object(read_json_file(path), "the file", where=where)
    splits = as_list(field(data, "splits", "", where=where), "splits", where=where)
    names = [as_str(split, f"splits[{i}]", where=where) for i, split in enumerate(splits)]
    for i, name in enumerate(names):
        if not SPLIT_NAME.match(name):
            raise ManifestError(f"splits[{i}] is {name[:80]!r}: not {SPLIT_NAME_RULE}", path=where)
    if len(set(names)) != len(names):  # each listed split is read whole: a name listed twice would pack it twice
        twice = next(name for i, name in enumerate(names) if name in names[:i])
        raise ManifestError(f"split {twice!r} is listed twice", path=where)
    return names


def _hub_split(name: str) -> str | None:
    match = HUB_FILE.match(name)
    return _split_name(match.group("split")) if match else None


def _arrow_names(folder: Path) -> list[str]:
    """The data files ``state.json`` lists (in its order), else ``data-*.arrow`` sorted."""
    state = folder / "state.json"
    if state.is_file():
        where = str(state)
        data = as_object(read_json_file(state), "the file", where=where)
        files = as_list(field(data, "_data_files", "", default=[], where=where), "_data_files", where=where)
        names: list[str] = []
        seen: set[str] = set()
        for i, entry in enumerate(files):
            what = f"_data_files[{i}]"
            entry = as_object(entry, what, where=where)
            name = as_str(field(entry, "filename", what, where=where), f"{what}.filename", where=where)
            if not name or "/" in name or name.startswith("."):
                raise ManifestError(f"{what}.filename is {name!r}: not a file in this folder", path=where)
            if name in seen:  # each file is read whole: one listed twice would pack its rows twice
                raise ManifestError(f"{what}.filename is {name!r}, listed before", path=where)
            seen.add(name)
            names.append(name)
        if names:
            return names
    names = sorted(p.name for p in folder.glob("data-*.arrow"))
    if not names:
        raise InputError("holds no data-*.arrow files (not a datasets.save_to_disk folder?)", path=str(folder))
    return names


def class_label_names(schema: Any, column: str, path: str, info_file: Path | None) -> tuple[str, ...] | None:
    """The ``ClassLabel`` names of ``column`` in the file ``path``: from the schema's ``huggingface`` metadata,
    else (``save_to_disk``) from ``dataset_info.json``'s features; None when the column is no ClassLabel."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw:
        try:
            value = parse_json(raw)
        except JSONError as exc:
            raise InputError(f"{HF_METADATA}: {exc}", path=path) from None
        metadata = as_object(value, HF_METADATA, where=path, error=InputError)
        info = as_object(field(metadata, "info", "", default={}, where=path, error=InputError),
                         f"{HF_METADATA}: info", where=path, error=InputError)
        features = field(info, "features", "", default=None, where=path, error=InputError)
        if features is not None:
            return _label_names(features, column, f"{HF_METADATA}: info.features", path, InputError)
    if info_file is not None and info_file.is_file():
        where = str(info_file)
        info = as_object(read_json_file(info_file), "the file", where=where)
        features = field(info, "features", "", default=None, where=where)
        if features is not None:
            return _label_names(features, column, "features", where, ManifestError)
    return None


def _label_names(features: Any, column: str, what: str, where: str,
                 error: type[InputError]) -> tuple[str, ...] | None:
    """The ``names`` of ``column``'s feature in a features object (named ``what`` in errors), each once."""
    features = as_object(features, what, where=where, error=error)
    feature = features.get(column)
    if feature is None:
        return None
    what = f"{what}.{column}"
    names = as_object(feature, what, where=where, error=error).get("names")
    if names is None:
        return None
    names = as_list(names, f"{what}.names", where=where, error=error)
    seen: set[str] = set()
    for i, name in enumerate(names):
        if as_str(name, f"{what}.names[{i}]", where=where, error=error) in seen:
            raise error(f"ClassLabel name {name[:80]!r} appears twice in {what}.names", path=where)
        if len(name) > MAX_CLASS_CHARS:
            raise error(f"{what}.names[{i}] is longer than {MAX_CLASS_CHARS} characters ({len(name):,})", path=where)
        seen.add(name)
    return tuple(names) or None


class _Labels:
    """Label cells to class numbers (first seen), renumbered by sorted name when the scan ends."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] | None = None
        self.numbers: dict[str, int] = {}

    def use_names(self, names: tuple[str, ...] | None, path: str, column: str) -> None:
        if self.numbers and (names is None) != (self.names is None) or (self.names and names != self.names):
            raise column_error(path, 0, column, "ClassLabel names differ from the other files'")
        if names is not None and self.names is None:
            self.names = names
            for name in names:  # every ClassLabel name is a class, even one no row uses
                self.numbers.setdefault(name, len(self.numbers))

    def number(self, value: Any, path: str, group: int, column: str) -> int | None:
        """The class number of a label cell; None for a missing label (null, or -1 under ClassLabel)."""
        if value is None:
            return None
        if self.names is not None:
            if isinstance(value, int):
                if value == -1:
                    return None
                if not 0 <= value < len(self.names):
                    raise column_error(path, group, column, f"label {value} is not one of the "
                                                            f"{len(self.names)} ClassLabel names")
                value = self.names[value]
            elif value not in self.numbers:
                raise column_error(path, group, column, f"label {str(value)[:80]!r} is not a ClassLabel name")
        name = str(value)
        if len(name) > MAX_CLASS_CHARS:
            raise column_error(path, group, column, f"label longer than {MAX_CLASS_CHARS} characters ({len(name):,})")
        return self.numbers.setdefault(name, len(self.numbers))

    def classes(self) -> tuple[str, ...]:
        return tuple(sorted(self.numbers))


def _meta_columns(schemas: Sequence[Any], pa: Any, skip: set[str]) -> tuple[str, ...]:
    """Scalar columns every file has (other than image, label and split): kept as per-sample metadata."""
    common = [name for name in schemas[0].names if name not in skip and all(name in s.names for s in schemas)]
    kept = tuple(n for n in common if all(is_scalar(pa, s.field(n).type) for s in schemas) and n not in RESERVED_META)
    left = sorted(set(common) - set(kept))
    if left:
        log.info("not kept as metadata (nested types, or names the packer's own fields use): %s", ", ".join(left))
    return kept


def scan_table_source(root: Path, container: str, image_column: str, label_column: str, *,
                      max_bytes: int = DEFAULT_MAX_BYTES):
    """Every row of every file (``container``: ``parquet`` or ``arrow``, a ``save_to_disk`` folder's) as a member:
    ``(classes, samples, skipped, MemberSpec)``, ``skipped`` as ``(relative path, reason)`` pairs. ``max_bytes``
    (``--max-bytes``) bounds what one row group may decode, here and when the packer reads the rows back."""
    pa = pyarrow()
    files = _table_files(root, container)
    if not files:
        raise InputError("holds no .parquet files", path=str(root))
    schemas = []
    for path, _, _ in files:
        with TableFile(path, container, max_bytes) as table:
            schemas.append(table.schema)
    labels, skipped = _Labels(), []
    builder = SamplesBuilder(str(root if root.is_dir() else root.parent), members=True, blocks=True)
    blocks = 0  # every row group of the source gets its own number: the unit the plan keeps together
    for (path, rel, layout_split), schema in zip(files, schemas):
        with arrow_guard(path, "unreadable schema"):
            kind_of_image = image_cell_kind(pa, schema, image_column, path)
            check_label_type(pa, schema, label_column, path)
            info = Path(path).parent / "dataset_info.json" if container == "arrow" else None
            labels.use_names(class_label_names(schema, label_column, path, info), path, label_column)
            has_split = SPLIT_COLUMN in schema.names and SPLIT_COLUMN not in (image_column, label_column)
            if has_split:
                check_split_type(pa, schema, SPLIT_COLUMN, path)
        columns = [image_column, label_column] + ([SPLIT_COLUMN] if has_split else [])
        mtime_ns = os.stat(path).st_mtime_ns
        with TableFile(path, container, max_bytes) as table:
            for group, first, data in table.groups(columns):
                blocks += 1
                with arrow_guard(path, f"{table.unit} {group}: unreadable cells"):
                    rows = _group_rows(pa, data, kind_of_image, columns, first)
                for row, size, label, split, problem in rows:
                    rel_path = member_path(rel, row)
                    number = labels.number(label, path, group, label_column) if problem is None else None
                    if problem is None and number is None:
                        problem = NO_LABEL
                    if problem is not None:
                        skipped.append((rel_path, problem))
                        continue
                    if has_split:
                        split = _checked_split(split, path, group)
                    builder.add(rel_path, number, split if has_split else layout_split, size, mtime_ns, row, blocks)
    classes = labels.classes()
    index_of = {name: i for i, name in enumerate(classes)}
    builder.renumber_labels([index_of[name] for name in labels.numbers])
    meta = _meta_columns(schemas, pa, {image_column, label_column, SPLIT_COLUMN})
    return classes, builder.build(), skipped, MemberSpec(container, image_column, meta, max_bytes)


def _group_rows(pa: Any, data: Any, image_kind: str, columns: list[str], first: int) -> list[tuple]:
    """``(row, image size, label, split, problem)`` of each row of one row group (its cells already counted
    against ``--max-bytes`` by ``TableFile``, so turning them into Python values is bounded)."""
    images, paths = image_cells(pa, data.column(columns[0]), image_kind)
    sizes = cell_sizes(pa, images)
    path_cells = paths.to_pylist() if paths is not None else [None] * len(sizes)
    labels = data.column(columns[1]).to_pylist()
    splits = data.column(columns[2]).to_pylist() if len(columns) > 2 else [None] * len(sizes)
    return [(first + i, size or 0, label, split, missing_image_reason(path_cell) if size is None else None)
            for i, (size, label, split, path_cell) in enumerate(zip(sizes, labels, splits, path_cells))]


def _checked_split(value: Any, path: str, group: int) -> str:
    if not isinstance(value, str) or not SPLIT_NAME.match(_split_name(value)):
        raise column_error(path, group, SPLIT_COLUMN, f"split {str(value)[:80]!r} is not {SPLIT_NAME_RULE}")
    return _split_name(value)


def fetch_table_members(spec: MemberSpec, container: str, wanted: Sequence[tuple[int, SourceSample]]
                        ) -> Iterator[tuple[int, MemberBytes]]:
    """The image cell (and metadata cells) of each wanted row of one file, read a row group at a time; a row the
    file no longer holds as scanned (changed since) is a problem, not an error of the whole shard."""
    try:
        mtime_ns = os.stat(container).st_mtime_ns
    except OSError as exc:
        for position, _ in wanted:
            yield position, MemberBytes(None, f"cannot read its file ({exc.strerror or exc})")
        return
    pa = pyarrow()
    by_row = sorted(wanted, key=lambda item: item[1].offset)
    rows = [sample.offset for _, sample in by_row]
    columns = [spec.image_column, *spec.meta_columns]
    at = 0
    with TableFile(container, spec.container, spec.max_bytes) as table:
        with arrow_guard(container, "unreadable schema"):
            kind = image_cell_kind(pa, table.schema, spec.image_column, container)
        for group, first, data in table.groups(columns, rows):
            stop = at
            while stop < len(rows) and rows[stop] < first + data.num_rows:
                stop += 1
            with arrow_guard(container, f"{table.unit} {group}: unreadable cells"):
                found = _wanted_cells(pa, data, spec, kind, by_row[at:stop], first, mtime_ns)
            yield from found
            at = stop
    for position, _ in by_row[at:]:
        yield position, MemberBytes(None, "row no longer in its file (changed since the scan)")


def _wanted_cells(pa: Any, data: Any, spec: MemberSpec, kind: str, wanted: Sequence[tuple[int, SourceSample]],
                  first: int, mtime_ns: int) -> list[tuple[int, MemberBytes]]:
    """The image and metadata cells of the ``wanted`` rows of one row group that starts at row ``first``."""
    # Cell by cell: only the wanted rows become Python values (``take`` would also import pandas, a second).
    images = image_cells(pa, data.column(spec.image_column), kind)[0]
    metas = [data.column(name) for name in spec.meta_columns]
    found = []
    for position, sample in wanted:
        i = sample.offset - first
        meta = {name: json_scalar(values[i].as_py()) for name, values in zip(spec.meta_columns, metas)}
        found.append((position, _checked_cell(images[i].as_py(), sample, mtime_ns, meta)))
    return found


def _checked_cell(data: bytes | None, sample: SourceSample, mtime_ns: int, meta: dict[str, Any]) -> MemberBytes:
    if mtime_ns != sample.mtime_ns or data is None or len(data) != sample.size:
        return MemberBytes(None, "its file changed since the scan")
    return MemberBytes(data, None, meta)
