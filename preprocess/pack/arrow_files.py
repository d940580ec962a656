"""One Parquet file or Arrow IPC stream file, read a row group (record batch) at a time, and its cells' types.

Both kinds of table file that image datasets arrive as (Parquet from the Hub and data lakes; Arrow IPC *stream*
files from ``datasets.save_to_disk``) are read here in bounded memory: one row group of only the columns asked
for, never the whole table. pyarrow is optional (the ``parquet`` extra) and imported only when such a file is read.

The checks on a column's type live here too, so the scan and the packer read cells the same way: an image cell is
binary, or a ``{bytes, path}`` struct (the Hugging Face ``Image`` feature) of which only ``bytes`` is ever used:
a path in a dataset is never followed (it would let a dataset make the packer read any file on the machine).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Sequence

from shards.bounded_read import open_regular_file
from shards.errors import InputError

PYARROW_HINT = "pip install 'shardcache[parquet]'"


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


class TableFile:
    """A context manager over one table file; ``schema`` is its Arrow schema, ``groups`` reads it in order."""

    def __init__(self, path: str, container: str):
        self.path, self.container = path, container
        self.pa = pyarrow()

    def __enter__(self) -> "TableFile":
        pa = self.pa
        self._handle = open_regular_file(self.path)  # never a FIFO or device named like a data file
        try:
            if self.container == "parquet":
                self._parquet = pa.parquet.ParquetFile(self._handle)
                self.schema = self._parquet.schema_arrow
            else:
                self._stream = pa.ipc.open_stream(self._handle)
                self.schema = self._stream.schema
        except (pa.ArrowException, OSError) as exc:
            self.close()
            what = "Parquet" if self.container == "parquet" else "Arrow IPC stream"
            raise InputError(f"not a readable {what} file ({_first_line(exc)})", path=self.path) from None
        return self

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
            for group in range(meta.num_row_groups):
                rows = meta.row_group(group).num_rows
                if wanted_rows is not None:
                    while at < len(wanted_rows) and wanted_rows[at] < first:
                        at += 1
                    if at == len(wanted_rows):
                        return
                    if wanted_rows[at] >= first + rows:
                        first += rows
                        continue
                # One thread: packing runs in --workers processes, forked after this scan has read.
                yield group, first, self._read(group, lambda: self._parquet.read_row_group(group, list(columns),
                                                                                           use_threads=False))
                first += rows
            return
        first = 0
        for group in itertools.count():
            batch = self._read(group, self._stream.read_next_batch, end_ok=True)
            if batch is None or (last is not None and first > last):
                return
            yield group, first, batch.select(list(columns))
            first += batch.num_rows

    def _read(self, group: int, read, end_ok: bool = False) -> Any:
        try:
            return read()
        except StopIteration:
            if end_ok:
                return None
            raise
        except (self.pa.ArrowException, OSError) as exc:
            raise InputError(f"row group {group}: unreadable ({_first_line(exc)})", path=self.path) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip() or type(exc).__name__).splitlines()[0][:200]


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
