"""One Parquet file or Arrow IPC stream file, read a row group (record batch) at a time, and its cells' types.

Both kinds of table file that image datasets arrive as (Parquet from the Hub and data lakes; Arrow IPC *stream*
files from ``datasets.save_to_disk``) are read here in bounded memory: one row group of only the columns asked
for, never the whole table. pyarrow is optional (the ``parquet`` extra) and imported only when such a file is read.

A table file is untrusted (docs/trust-model.md, "One door"), and pyarrow trusts what a file declares, so every
read is bounded and checked first, and every pyarrow call runs inside ``parser_guard`` (one ``InputError`` naming
the file, never a traceback):
- A row group is decoded only if its metadata says it fits in ``max_bytes`` (``--max-bytes``): its uncompressed
  size, and 16 bytes a row for each column read. A few KB of zstd can hold GBs of zeros. (The row group's size
  counts every column, not only those read: pyarrow aborts the process when asked for a corrupt column chunk's
  own metadata, ``row_group(i).column(j)``, so that is never asked.)
- Byte-array columns are read as dictionaries, and of a struct column only its flat children: a value stored once
  and indexed by every row (a *dictionary* bomb, invisible in the sizes above) stays one value in memory, and is
  counted once per row (``cell_bytes``) against ``max_bytes`` before any cell is used. So each cell is bounded too.
- An Arrow stream's messages are walked by their headers first (``_check_messages``): a compressed body, or one
  larger than ``max_bytes`` or than the file, is refused before pyarrow reads it.
- Every row group and record batch is validated in full before use: pyarrow reads a batch's buffers as declared,
  and a corrupt offset aborts the process (SIGSEGV, SIGABRT) when a cell is read.
What is not bounded: a Parquet page header may lie about its uncompressed size, and pyarrow allocates what it says
(at most 2 GiB, the format's limit) while decompressing that page.

The checks on a column's type live here too, so the scan and the packer read cells the same way: an image cell is
binary, or a ``{bytes, path}`` struct (the Hugging Face ``Image`` feature) of which only ``bytes`` is ever used:
a path in a dataset is never followed (it would let a dataset make the packer read any file on the machine).
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from collections import Counter
from contextlib import AbstractContextManager
from typing import Any, Iterator, Sequence

from preprocess.pack.sources.members import DEFAULT_MAX_BYTES
from shards.door.bounded_read import open_regular_file, parser_guard
from shards.errors import InputError
from shards.door.shape import as_int
from shards.units import human_bytes

PYARROW_HINT = "pip install 'shardcache[parquet]'"
KIND_NAMES = {"parquet": "Parquet", "arrow": "Arrow IPC stream"}
ROW_OVERHEAD_BYTES = 16  # what a decoded row costs a column besides its bytes: offsets, indices, validity
# Arrow IPC message header types (format/Message.fbs) that carry a body of column buffers.
DICTIONARY_BATCH, RECORD_BATCH = 2, 3


def pyarrow() -> Any:
    """The ``pyarrow`` module with its compute, ipc and parquet parts loaded, or an InputError naming the extra."""
    try:
        import pyarrow as pa
        import pyarrow.compute  # noqa: F401
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise InputError(f"reading Parquet or Arrow files needs pyarrow ({PYARROW_HINT})") from None
    return pa


def arrow_guard(path: str, what: str) -> AbstractContextManager[None]:
    """``parser_guard`` for pyarrow on the file ``path``: any failure, pyarrow's own too, is one InputError."""
    return parser_guard(path, what, error=InputError, catch=(pyarrow().ArrowException,))


class TableFile:
    """A context manager over one table file; ``schema`` is its Arrow schema (the file's own column types),
    ``groups`` reads it in order, each row group bounded by ``max_bytes`` and validated (see the module docstring)."""

    def __init__(self, path: str, container: str, max_bytes: int = DEFAULT_MAX_BYTES):
        self.path, self.container, self.max_bytes = path, container, max_bytes
        self.unit, self.units = ("row group", "row groups") if container == "parquet" else ("record batch",
                                                                                            "record batches")
        self.pa = pyarrow()

    def __enter__(self) -> "TableFile":
        self._handle = open_regular_file(self.path)  # never a FIFO or device named like a data file
        try:
            with arrow_guard(self.path, f"not a readable {KIND_NAMES[self.container]} file"):
                self._open_parquet() if self.container == "parquet" else self._open_stream()
                twice = sorted(name for name, count in Counter(self.schema.names).items() if count > 1)
                if twice:  # pyarrow finds no column of a name two columns have
                    raise InputError(f"column {twice[0]!r} appears twice", path=self.path)
        except BaseException:
            self.close()
            raise
        return self

    def _open_parquet(self) -> None:
        parquet = self.pa.parquet
        plain = parquet.ParquetFile(self._handle)
        self.schema, meta = plain.schema_arrow, plain.metadata
        leaves = [meta.schema.column(i) for i in range(meta.num_columns)]
        # Leaves inside a list or map are never read: they may decode to more values than the row group has rows.
        self._flat = [leaf.path for leaf in leaves if leaf.max_repetition_level == 0]
        text = [i for i, leaf in enumerate(leaves) if leaf.physical_type == "BYTE_ARRAY"]
        self._parquet = parquet.ParquetFile(self._handle, metadata=meta, read_dictionary=text) if text else plain

    def _open_stream(self) -> None:
        self._check_messages()
        self._stream = self.pa.ipc.open_stream(self._handle)
        self.schema = self._stream.schema

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle is not None:
            handle.close()

    def groups(self, columns: Sequence[str],
               wanted_rows: Sequence[int] | None = None) -> Iterator[tuple[int, int, Any]]:
        """``(row group number, first row, table of ``columns``)`` for each row group in order; with
        ``wanted_rows`` (sorted) only groups holding one of them, and none after the last."""
        last = wanted_rows[-1] if wanted_rows else None
        if self.container == "parquet":
            meta, first, at = self._parquet.metadata, 0, 0
            paths = [path for path in self._flat if any(path == c or path.startswith(c + ".") for c in columns)]
            for group in range(meta.num_row_groups):
                row_group = meta.row_group(group)
                rows = as_int(row_group.num_rows, f"row group {group}: num_rows", where=self.path, error=InputError)
                if wanted_rows is not None:
                    while at < len(wanted_rows) and wanted_rows[at] < first:
                        at += 1
                    if at == len(wanted_rows):
                        return
                    if wanted_rows[at] >= first + rows:
                        first += rows
                        continue
                declared = max(0, row_group.total_byte_size) + ROW_OVERHEAD_BYTES * rows * len(paths)
                self._check_size(f"row group {group}", declared, "uncompressed")
                # One thread: packing runs in --workers processes, forked after this scan has read.
                yield group, first, self._read(group, lambda: self._parquet.read_row_group(group, paths,
                                                                                           use_threads=False))
                first += rows
            return
        first = 0
        for group in itertools.count():
            if last is not None and first > last:
                return
            batch = self._read(group, lambda: self._next_batch(columns))
            if batch is None:
                return
            yield group, first, batch
            first += batch.num_rows

    def _next_batch(self, columns: Sequence[str]) -> Any:
        try:
            return self._stream.read_next_batch().select(list(columns))
        except StopIteration:
            return None

    def _read(self, group: int, read) -> Any:
        """What ``read`` gives (a table or batch, None at the end), validated and its cells counted."""
        with arrow_guard(self.path, f"{self.unit} {group}: unreadable"):
            data = read()
            if data is not None:
                data.validate(full=True)
                self._check_size(f"{self.unit} {group}", cell_bytes(self.pa, data), "once its cells are read")
            return data

    def _check_size(self, name: str, size: int, how: str) -> None:
        if size > self.max_bytes:
            raise InputError(f"{name} holds {human_bytes(size)} {how}, more than --max-bytes "
                             f"({human_bytes(self.max_bytes)}): not read (write the file in smaller {self.units}, "
                             "or give a larger --max-bytes)", path=self.path)

    def _check_messages(self) -> None:
        """Walk the stream's messages by their headers, skipping their bodies, before pyarrow reads any: a body
        is refused if compressed (pyarrow would decompress it whole; ``datasets.save_to_disk`` writes none),
        larger than ``max_bytes`` or past the end of the file. Then back to the start."""
        handle, size = self._handle, os.fstat(self._handle.fileno()).st_size
        batch = 0
        while handle.tell() < size:
            length = _read_int32(handle)
            if length == -1:  # the continuation marker before each message (format 0.15 and later)
                length = _read_int32(handle)
            if length == 0:  # end of stream
                break
            if not 0 < length <= size - handle.tell():
                raise ValueError(f"message {length} bytes long, past the end of the file")
            kind, body, compressed = _message_header(handle.read(length))
            if not 0 <= body <= size - handle.tell():
                raise ValueError(f"message body {body} bytes long, past the end of the file")
            if kind in (DICTIONARY_BATCH, RECORD_BATCH):
                name = f"record batch {batch}" if kind == RECORD_BATCH else f"a dictionary batch (before {batch})"
                if compressed:
                    raise InputError(f"{name} is compressed: not read (decompressing takes memory its size does not "
                                     "show; datasets.save_to_disk writes uncompressed streams)", path=self.path)
                self._check_size(name, body, "in its body")
            batch += kind == RECORD_BATCH
            handle.seek(body, os.SEEK_CUR)
        handle.seek(0)


def _read_int32(handle: Any) -> int:
    data = handle.read(4)
    if len(data) != 4:
        raise ValueError("truncated message prefix")
    return struct.unpack("<i", data)[0]


class _FlatTable:
    """One table of a flatbuffer, the encoding of Arrow IPC message headers: its fields by number, every offset
    checked against the buffer (a hostile header must not make ``struct`` read from the end)."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        self.vtable = pos - self._unpack("<i", pos)
        self.vtable_len = self._unpack("<H", self.vtable)

    def _unpack(self, fmt: str, at: int) -> int:
        if not 0 <= at <= len(self.buf) - struct.calcsize(fmt):
            raise ValueError("message header offset out of range")
        return struct.unpack_from(fmt, self.buf, at)[0]

    def where(self, field: int) -> int | None:
        slot = 4 + 2 * field
        offset = self._unpack("<H", self.vtable + slot) if slot + 2 <= self.vtable_len else 0
        return self.pos + offset if offset else None

    def scalar(self, field: int, fmt: str) -> int:
        at = self.where(field)
        return 0 if at is None else self._unpack(fmt, at)

    def table(self, field: int) -> "_FlatTable | None":
        at = self.where(field)
        return None if at is None else _FlatTable(self.buf, at + self._unpack("<I", at))


def _message_header(meta: bytes) -> tuple[int, int, bool]:
    """``(header type, body length, compressed)`` of an IPC message header (``Message``: 1 header_type, 2 header,
    3 bodyLength; ``RecordBatch``: 3 compression; ``DictionaryBatch``: 1 data, a RecordBatch)."""
    if len(meta) < 4:
        raise ValueError("message header too short")
    message = _FlatTable(meta, struct.unpack_from("<I", meta)[0])  # the root table's offset
    kind, body, header = message.scalar(1, "<B"), message.scalar(3, "<q"), message.table(2)
    if kind == DICTIONARY_BATCH and header is not None:
        header = header.table(1)
    return kind, body, kind in (DICTIONARY_BATCH, RECORD_BATCH) and header is not None and header.where(3) is not None


def _chunks(pa: Any, values: Any) -> list[Any]:
    return values.chunks if isinstance(values, pa.ChunkedArray) else [values]


def cell_bytes(pa: Any, values: Any) -> int:
    """The bytes ``values`` (a table, batch, column or array) holds with every cell its own value: a dictionary
    column's cells counted once per row (one 50 MiB value that 100 rows index is 5 GiB once they are read), a
    struct by its children, any other array by its buffers."""
    if isinstance(values, (pa.Table, pa.RecordBatch)):
        return sum(cell_bytes(pa, column) for column in values.columns)
    total = 0
    for chunk in _chunks(pa, values):
        kind = chunk.type
        if pa.types.is_struct(kind):
            total += sum(cell_bytes(pa, chunk.field(i)) for i in range(kind.num_fields))
        elif pa.types.is_dictionary(kind) and (_is_binary(pa, kind.value_type) or _is_string(pa, kind.value_type)):
            lengths = _lengths(pa, chunk.dictionary).take(chunk.indices)
            total += (pa.compute.sum(lengths).as_py() or 0) + chunk.indices.nbytes
        else:
            total += chunk.nbytes
    return total


def cell_sizes(pa: Any, values: Any) -> list[int | None]:
    """The byte length of each cell of a binary column (None for a null); a dictionary column's without
    expanding it."""
    sizes: list[int | None] = []
    for chunk in _chunks(pa, values):
        if pa.types.is_dictionary(chunk.type):
            sizes += _lengths(pa, chunk.dictionary).take(chunk.indices).to_pylist()
        else:
            sizes += _lengths(pa, chunk).to_pylist()
    return sizes


def _lengths(pa: Any, array: Any) -> Any:
    """``binary_length`` of a binary or string array, views too (which it has no kernel for: copied first)."""
    views = (getattr(pa.types, "is_binary_view", None), getattr(pa.types, "is_string_view", None))
    if any(check is not None and check(array.type) for check in views):
        array = array.cast(pa.large_binary())
    return pa.compute.binary_length(array)


def column_error(path: str, group: int, column: str, what: str) -> InputError:
    """The one-line error for a bad column: names the file, the row group and the column."""
    return InputError(f"row group {group}, column {column!r}: {what}", path=path)


def image_cell_kind(pa: Any, schema: Any, column: str, path: str) -> str:
    """``binary`` or ``struct`` (``{bytes, path}``), or the InputError saying why the column holds no images."""
    if column not in schema.names:
        raise column_error(path, 0, column, f"no such column (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    if _is_binary(pa, kind):
        return "binary"
    if pa.types.is_struct(kind):
        names = [kind.field(i).name for i in range(kind.num_fields)]
        if "bytes" in names and _is_binary(pa, kind.field("bytes").type):
            return "struct"
        if "path" in names:
            raise column_error(path, 0, column, "image cells hold only a path, no bytes; shardcache never follows "
                                                "a path from a dataset (store the image bytes in the file)")
    raise column_error(path, 0, column, f"type {kind} holds no image bytes (expected binary, or a {{bytes, path}} "
                                        "struct as the Hugging Face Image feature stores)")


def check_label_type(pa: Any, schema: Any, column: str, path: str) -> None:
    if column not in schema.names:
        raise column_error(path, 0, column, f"no such column (columns: {', '.join(schema.names)})")
    kind = schema.field(column).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if not (pa.types.is_integer(kind) or _is_string(pa, kind)):
        raise column_error(path, 0, column, f"type {kind} cannot be read as a label (an integer or a string)")


def check_split_type(pa: Any, schema: Any, column: str, path: str) -> None:
    kind = schema.field(column).type
    if not _is_string(pa, kind.value_type if pa.types.is_dictionary(kind) else kind):
        raise column_error(path, 0, column, f"type {kind} cannot be read as a split name (a string)")


def is_scalar(pa: Any, kind: Any) -> bool:
    """Whether cells of this type can be per-sample metadata (numbers, booleans, strings)."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
            or _is_string(pa, kind))


def image_cells(pa: Any, values: Any, kind: str) -> tuple[Any, Any]:
    """The image bytes of a column (binary cells, or the ``bytes`` of struct cells) and, for structs, the paths
    (only to say why a cell without bytes is skipped)."""
    if kind == "binary":
        return values, None
    paths = pa.compute.struct_field(values, "path") if values.type.get_field_index("path") >= 0 else None
    return pa.compute.struct_field(values, "bytes"), paths


def missing_image_reason(path_cell: Any) -> str:
    if path_cell:
        return f"image cell holds only a path ({str(path_cell)[:80]!r}), never followed"
    return "image cell is empty (null)"


def json_scalar(value: Any) -> Any:
    """A cell as a JSON value: NaN and infinities (which JSON cannot hold) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _is_binary(pa: Any, kind: Any) -> bool:
    checks = (pa.types.is_binary, pa.types.is_large_binary, getattr(pa.types, "is_binary_view", None))
    return any(check is not None and check(kind) for check in checks)


def _is_string(pa: Any, kind: Any) -> bool:
    checks = (pa.types.is_string, pa.types.is_large_string, getattr(pa.types, "is_string_view", None))
    return any(check is not None and check(kind) for check in checks)
