"""``where="width >= 256 and mode == 'RGB'"``: a filter on per-sample metadata, parsed, never evaluated as Python.

The expression is the caller's, but the values it is compared with come from a dataset (untrusted): so it is parsed
with ``ast`` into a small tree of comparisons, ``and``/``or``/``not``, field names and literal constants, and
evaluated by the walker below. Calls, attributes, subscripts, arithmetic and every other node are refused when the
filter is built, with a one-line error naming what is not allowed. A sample's fields are its JSON metadata (for
packed images: path, class, width, height, mode, format) plus ``key``, ``label`` (the class index in the source's
own manifest) and ``class`` (its name). A field a sample lacks is an error naming the field and the sample, since
a silent "no match" would quietly shrink the training set.

The expression is bounded before it is walked: at most ``MAX_WHERE_CHARS`` characters and ``MAX_WHERE_DEPTH`` levels
of syntax tree (measured without recursion). Both the checker and the evaluator below recurse once or twice per
level, and Python's parser itself fails with ``RecursionError`` or ``MemoryError`` on a few thousand nested
``not``; a real filter is a few comparisons joined by ``and``/``or`` (a long list of keys belongs in ``keys=``).

``Where.mask`` evaluates the same tree over whole columns (``shards.formats.columns``: numbers as bool/int64/float64
arrays, strings as UTF-8 ``S`` bytes, whose byte order is code point order) with exactly the row-by-row semantics:
``and``/``or`` and chained comparisons pass a mask of the rows still being evaluated to their right side, so a
field missing or a type mismatch on a row the row-wise filter would never look at is not an error, and an error
names the sample the row-wise filter would have stopped at (the first row that fails, and on that row the first
failure in evaluation order).
"""

from __future__ import annotations

import ast
import io
import operator
import tokenize
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

import numpy as np

from shards.errors import InputError

_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_LITERALS = (int, float, str, bool, type(None))
MAX_WHERE_CHARS = 8192
MAX_WHERE_DEPTH = 32
# Field names that are Python keywords ("class"), renamed before parsing and back when looked up.
_KEYWORD_FIELDS = {"class": "class_"}
_FIELD_OF = {renamed: name for name, renamed in _KEYWORD_FIELDS.items()}


def _keyword_fields(expression: str) -> str:
    """``class == 'cat'`` parses as ``class_ == 'cat'`` (tokens, so strings holding the word are untouched)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(expression).readline))
    except (tokenize.TokenError, SyntaxError):
        return expression  # ast.parse reports the syntax error
    out = [(t.type, _KEYWORD_FIELDS.get(t.string, t.string) if t.type == tokenize.NAME else t.string) for t in tokens]
    return tokenize.untokenize(out)


def _shortened(expression: str, keep: int = 60) -> str:
    """The expression for an error line: a deep one is thousands of characters of ``not not ...``."""
    return repr(expression) if len(expression) <= keep else repr(expression[:keep]) + f"... ({len(expression):,} chars)"


def _depth_exceeds(tree: ast.AST, limit: int) -> bool:
    """Whether the syntax tree is more than ``limit`` nodes deep; level by level, so no recursion."""
    level, depth = [tree], 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [child for node in level for child in ast.iter_child_nodes(node)]
    return False


class Where:
    """A compiled filter: ``Where("width >= 256")(fields) -> bool``. Picklable (it keeps only its text and tree)."""

    def __init__(self, expression: str):
        if not isinstance(expression, str) or not expression.strip():
            raise InputError(f"where={expression!r}: give a filter such as \"width >= 256\"")
        self.expression = expression
        if len(expression) > MAX_WHERE_CHARS:
            raise InputError(f"where={_shortened(expression)} is longer than {MAX_WHERE_CHARS:,} characters; "
                             "select many keys with keys= instead")
        too_deep = f"where={_shortened(expression)} nests deeper than {MAX_WHERE_DEPTH} levels"
        try:
            tree = ast.parse(_keyword_fields(expression.strip()), mode="eval")
        except SyntaxError as exc:
            raise InputError(f"where={expression!r} is not a valid filter ({exc.msg})") from None
        except (RecursionError, MemoryError):  # the parser's own guards against deep nesting
            raise InputError(too_deep) from None
        if _depth_exceeds(tree, MAX_WHERE_DEPTH):
            raise InputError(too_deep)
        self._tree = tree.body
        self._check(self._tree)

    def __repr__(self) -> str:
        return f"Where({self.expression!r})"

    @property
    def fields(self) -> frozenset[str]:
        """The field names the filter looks at."""
        return frozenset(_FIELD_OF.get(n.id, n.id) for n in ast.walk(self._tree) if isinstance(n, ast.Name))

    def mask(self, columns: Columns, live: np.ndarray | None = None) -> np.ndarray:
        """``[self(row) for row in rows]`` over whole columns, False where ``live`` is; raises the InputError the
        row-wise filter raises at the first live row it fails on."""
        mask, failure = self.mask_until_error(columns, live)
        if failure is not None:
            raise failure.error
        return mask

    def mask_until_error(self, columns: Columns, live: np.ndarray | None = None) -> tuple[np.ndarray, Failure | None]:
        """``mask`` without raising: the mask (valid on rows before the failing one) and the first failure."""
        live = np.ones(columns.rows, dtype=bool) if live is None else np.asarray(live, dtype=bool)
        vector = _Vector(self.expression, columns)
        value = vector.eval(self._tree, live)
        return live & vector.truth(value), vector.failure

    def _check(self, node: ast.AST) -> None:
        if isinstance(node, ast.BoolOp):
            for value in node.values:
                self._check(value)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self._check(node.operand)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
                and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
            pass  # a negative number
        elif isinstance(node, ast.Compare):
            if any(type(op) not in _COMPARE for op in node.ops):
                raise InputError(f"where={self.expression!r}: only ==, !=, <, <=, >, >=, in, not in compare")
            for part in (node.left, *node.comparators):
                self._check(part)
        elif isinstance(node, (ast.Tuple, ast.List)):
            for element in node.elts:
                if not (isinstance(element, ast.Constant) and isinstance(element.value, _LITERALS)):
                    raise InputError(f"where={self.expression!r}: a list may hold only literal values")
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, _LITERALS):
                raise InputError(f"where={self.expression!r}: {node.value!r} is not a number, string or bool")
        elif not isinstance(node, ast.Name):
            raise InputError(f"where={self.expression!r}: {type(node).__name__} is not allowed (fields, literals, "
                             "comparisons, and/or/not only)")

    def __call__(self, fields: Mapping[str, Any]) -> bool:
        return bool(self._eval(self._tree, fields))

    def _eval(self, node: ast.AST, fields: Mapping[str, Any]) -> Any:
        if isinstance(node, ast.BoolOp):
            values = (self._eval(v, fields) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.UnaryOp):
            value = self._eval(node.operand, fields)
            return (not value) if isinstance(node.op, ast.Not) else -value
        if isinstance(node, ast.Compare):
            left = self._eval(node.left, fields)
            for op, right_node in zip(node.ops, node.comparators):
                right = self._eval(right_node, fields)
                try:
                    if not _COMPARE[type(op)](left, right):
                        return False
                except TypeError:
                    raise InputError(f"where={self.expression!r}: cannot compare {left!r} with {right!r} "
                                     f"[sample {fields.get('key')}]") from None
                left = right
            return True
        if isinstance(node, (ast.Tuple, ast.List)):
            return tuple(element.value for element in node.elts)
        if isinstance(node, ast.Constant):
            return node.value
        name = _FIELD_OF.get(node.id, node.id)
        if name not in fields:
            raise InputError(f"where={self.expression!r}: sample {fields.get('key')!r} has no field {name!r} "
                             f"(it has {', '.join(sorted(fields))})")
        return fields[name]


# -- over columns -------------------------------------------------------------------------------------------------

class Columns(Protocol):
    """What ``Where.mask`` reads: ``rows``, the field names (``key`` among them, to name a failing sample), each
    field's values (``KeyError`` when absent) and its presence mask (None: every row has it)."""

    rows: int
    fields: tuple[str, ...]

    def column(self, name: str) -> np.ndarray: ...

    def present(self, name: str) -> np.ndarray | None: ...


class ArrayColumns:
    """``Columns`` from a dict of arrays (and of presence masks), for tests and derived views."""

    def __init__(self, arrays: Mapping[str, np.ndarray], present: Mapping[str, np.ndarray] | None = None):
        self._arrays, self._present = dict(arrays), dict(present or {})
        self.fields = tuple(self._arrays)
        self.rows = len(next(iter(self._arrays.values()))) if self._arrays else 0

    def column(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def present(self, name: str) -> np.ndarray | None:
        return self._present.get(name)


@dataclass(frozen=True)
class Failure:
    """The first row on which the row-wise filter raises, and what it raises."""

    row: int
    error: InputError


@dataclass(frozen=True)
class _Const:
    value: Any


_SMALL_IN = 64  # up to this many literals, ``x in (...)`` is one comparison per literal; beyond, np.isin


def _kind(value: Any) -> str:
    """``num``, ``str``, ``none`` or ``tuple``: what decides whether Python can compare two values."""
    if isinstance(value, np.ndarray):
        return "str" if value.dtype.kind == "S" else "num"
    return {bool: "num", int: "num", float: "num", str: "str", tuple: "tuple"}.get(type(value.value), "none")


def _operand(value: Any) -> Any:
    """What numpy compares: the array, or the literal (a string as the UTF-8 bytes the columns hold)."""
    if isinstance(value, np.ndarray):
        return value
    return value.value.encode("utf-8", "surrogatepass") if isinstance(value.value, str) else value.value


def column_value(column: np.ndarray, row: int) -> Any:
    """The Python value (str, bool, int or float) a column holds on ``row``, as the row-wise filter sees it."""
    item = column[row]
    if column.dtype.kind == "S":
        return bytes(item).decode("utf-8", "surrogatepass")
    return {"b": bool, "i": int, "u": int}.get(column.dtype.kind, float)(item)


def member_bytes(column: np.ndarray, wanted: Iterable[bytes], chunk: int = 1 << 16) -> np.ndarray:
    """Which rows of an ``S`` column equal one of ``wanted``: a binary search in the sorted wanted values, a chunk
    of rows at a time (no copy of the column)."""
    width = column.dtype.itemsize
    table = np.unique(np.asarray([w for w in wanted if len(w) <= width and not w.endswith(b"\0")],
                                 dtype=column.dtype))
    out = np.zeros(len(column), dtype=bool)
    if not len(table):
        return out
    for start in range(0, len(column), chunk):
        part = column[start:start + chunk]
        at = np.minimum(np.searchsorted(table, part), len(table) - 1)
        out[start:start + chunk] = table[at] == part
    return out


class _Vector:
    """One evaluation of a filter tree over columns: values are numpy arrays (one per row) or ``_Const``."""

    def __init__(self, expression: str, columns: Columns):
        self.expression, self.columns = expression, columns
        self.failure: Failure | None = None

    def _fail(self, rows: np.ndarray, message: Callable[[int], str]) -> None:
        """Record a failure on the first of ``rows`` (a mask) unless one is recorded on an earlier row (or on the
        same row, earlier in evaluation order)."""
        hits = np.flatnonzero(rows)
        if not len(hits):
            return
        row = int(hits[0])
        if self.failure is None or row < self.failure.row:
            self.failure = Failure(row, InputError(message(row)))

    def _key(self, row: int) -> str | None:
        if "key" not in self.columns.fields:
            return None
        return self._python(self.columns.column("key"), row)

    @staticmethod
    def _python(value: Any, row: int) -> Any:
        return value.value if isinstance(value, _Const) else column_value(value, row)

    def truth(self, value: Any) -> np.ndarray | bool:
        if isinstance(value, _Const):
            return bool(value.value)
        if value.dtype == bool:
            return value
        return value != (b"" if value.dtype.kind == "S" else 0)

    def eval(self, node: ast.AST, live: np.ndarray) -> Any:
        rows = self.columns.rows
        if isinstance(node, ast.BoolOp):
            pending, passed = live.copy(), np.zeros(rows, dtype=bool)
            for part in node.values:  # each part on the rows whose answer is still open, as all()/any() do
                truth = self.truth(self.eval(part, pending))
                if isinstance(node.op, ast.And):
                    pending &= truth
                else:
                    passed |= pending & truth
                    pending &= np.logical_not(truth)
            return pending if isinstance(node.op, ast.And) else passed
        if isinstance(node, ast.UnaryOp):
            value = self.eval(node.operand, live)
            if isinstance(node.op, ast.Not):
                return ~np.broadcast_to(self.truth(value), (rows,))
            return _Const(-value.value)
        if isinstance(node, ast.Compare):
            pending = live.copy()
            left = self.eval(node.left, pending)
            for op, right_node in zip(node.ops, node.comparators):
                right = self.eval(right_node, pending)
                pending &= self._compare(op, left, right, pending)
                left = right
            return pending
        if isinstance(node, (ast.Tuple, ast.List)):
            return _Const(tuple(element.value for element in node.elts))
        if isinstance(node, ast.Constant):
            return _Const(node.value)
        return self._field(_FIELD_OF.get(node.id, node.id), live)

    def _field(self, name: str, live: np.ndarray) -> Any:
        columns = self.columns
        has = columns.present(name) if name in columns.fields else None
        if name not in columns.fields or has is not None:
            lacking = live if name not in columns.fields else live & ~has

            def message(row: int) -> str:
                names = [f for f in columns.fields if columns.present(f) is None or columns.present(f)[row]]
                return (f"where={self.expression!r}: sample {self._key(row)!r} has no field {name!r} "
                        f"(it has {', '.join(sorted(names))})")
            self._fail(lacking, message)
            if name not in columns.fields:
                return _Const(None)
        return columns.column(name)

    def _compare(self, op: ast.cmpop, left: Any, right: Any, live: np.ndarray) -> np.ndarray:
        """``left op right`` on every row, False where Python raises (recorded on the first live row)."""
        rows = self.columns.rows
        try:
            if isinstance(left, _Const) and isinstance(right, _Const):
                result = bool(_COMPARE[type(op)](left.value, right.value))
            else:
                result = self._compare_arrays(op, left, right)
        except TypeError:
            self._fail(live, lambda row: f"where={self.expression!r}: cannot compare {self._python(left, row)!r} "
                                         f"with {self._python(right, row)!r} [sample {self._key(row)}]")
            return np.zeros(rows, dtype=bool)
        return np.full(rows, result) if isinstance(result, bool) else np.asarray(result, dtype=bool)

    def _compare_arrays(self, op: ast.cmpop, left: Any, right: Any) -> Any:
        """One side at least is a column: Python's rules by kind (numbers with numbers, strings with strings;
        ``==`` across kinds is False; ordering across kinds is a TypeError)."""
        if isinstance(op, (ast.In, ast.NotIn)):
            found = self._contains(right, left)
            return ~found if isinstance(op, ast.NotIn) else found
        same = _kind(left) == _kind(right)
        if isinstance(op, (ast.Eq, ast.NotEq)):
            if not same:
                return isinstance(op, ast.NotEq)
        elif not same:
            raise TypeError
        return _COMPARE[type(op)](_operand(left), _operand(right))

    def _contains(self, container: Any, item: Any) -> np.ndarray:
        """``item in container`` on every row: a literal list (equality with any of its values), or a string
        (substring); anything else cannot hold values (TypeError)."""
        kind, item_kind = _kind(container), _kind(item)
        if kind == "tuple":
            values = container.value
            if item_kind == "str":
                return member_bytes(item, [v.encode("utf-8", "surrogatepass") for v in values if type(v) is str])
            numbers = [v for v in values if type(v) in (bool, int, float)]
            if len(numbers) > _SMALL_IN:
                return np.isin(item, np.asarray(numbers, dtype=np.float64))
            found = np.zeros(self.columns.rows, dtype=bool)
            for number in numbers:
                found |= item == number
            return found
        if kind != "str" or item_kind != "str":
            raise TypeError
        if isinstance(container, _Const):  # a column's values within one literal string: once per distinct value
            distinct, inverse = np.unique(item, return_inverse=True)
            text = container.value
            hits = np.asarray([bytes(v).decode("utf-8", "surrogatepass") in text for v in distinct], dtype=bool)
            return hits[inverse]
        return np.strings.find(container, _operand(item)) >= 0
